"""ZeRO's cost on one GPU: the 110 M GPT of zero_bench.toml (batch 8 x 128 tokens) at [zero]
stage 0-3 on one rank, where sharding saves nothing and every stage-3 unit is still gathered
and released around its forward and backward: step time and peak GPU memory, interleaved
rounds, medians. Run by `scripts/gpu-check run zero` on a GPU machine.
usage: python examples/bench/zero/one_gpu.py [--rounds 2] [--steps 30] [--json FILE]"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zero_bench.toml")
LOOM = os.path.join(ROOT, "build/bin/loom")


def run(stage, steps):
    out = tempfile.mkdtemp(prefix="loom-zero-gpu-")
    sets = [f"train.max_steps={steps}", f"train.output_dir={out}", f"zero.stage={stage}",
            "train.device=cuda", "train.per_device_train_batch_size=8"]
    subprocess.run([LOOM, "run", JOB] + [x for s in sets for x in ("--set", s)], check=True,
                   stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    shutil.rmtree(out, ignore_errors=True)
    return (statistics.median(r["step_time_s"] for r in rows[5:]),
            max(r["mem_peak_bytes"] for r in rows))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--json")
    a = p.parse_args()
    res = {s: {"step": [], "peak": []} for s in range(4)}
    for r in range(a.rounds):
        for stage in (range(4) if r % 2 == 0 else reversed(range(4))):
            step, peak = run(stage, a.steps)
            res[stage]["step"].append(step)
            res[stage]["peak"].append(peak)
            print(f"round {r + 1} stage {stage}: {step * 1000:.1f} ms, peak {peak / 2**20:.0f} MiB",
                  flush=True)
    base = statistics.median(res[0]["step"])
    print("| stage | step (ms) | vs stage 0 | peak GPU memory (MiB) |\n|---|---|---|---|")
    for stage in range(4):
        step = statistics.median(res[stage]["step"])
        print(f"| {stage} | {step * 1000:.1f} | {step / base:.2f}x | "
              f"{max(res[stage]['peak']) / 2**20:.0f} |")
    if a.json:
        json.dump(res, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
