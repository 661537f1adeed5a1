"""Muon's step cost against AdamW's in a whole training step, and under ZeRO on 2 ranks.

Not a rule-only benchmark (bench_optim.py is): Muon's cost is its Newton-Schulz matmuls, which
depend on the matrices' shapes, so it is measured in real GPT steps. Every (model, rule) pair
runs in its own process, the pairs interleaved per round; each run's first step is dropped and
the median of the rest taken, then the median over rounds. The ZeRO part runs the small model on
2 ranks (gloo) at stages 1 and 2 and reports the step time and each rank's optimizer shard
(bytes of its optimizer-0000R-of-00002.safetensors: Muon gives every rank whole tensors, Note
[Muon under ZeRO] in plugins/optim/muon.cpp, so the shards are less even than AdamW's).

usage: .venv/bin/python examples/bench/optim/muon.py [--rounds 3] [--steps 6] [--big-steps 3]
"""
import argparse
import glob
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import benchlib  # noqa: E402

JOB = os.path.join(benchlib.ROOT, "examples/bench/zero/zero_bench.toml")
MODELS = {
    # The demo's model (examples/demo.toml) on random tokens, its batch of 16 x 128.
    "demo 128x4": ["model.n_embd=128", "model.n_layer=4", "model.n_head=4",
                   "model.vocab_size=256", "data.vocab_high=256",
                   "train.per_device_train_batch_size=16"],
    # GPT-2 small's body (768 wide, 12 layers) with a 32 000 vocabulary, batch 1 x 128.
    "gpt2-small 768x12": [],
}
RULES = {
    "adamw": ["optimizer.name=adamw", "optimizer.weight_decay=0.1"],
    "muon": ["optimizer.name=muon"],
}


def step_time(rows):
    times = [r["step_time_s"] for r in rows[1:]]
    return statistics.median(times)


def zero_run(sets, stage):
    """(median step time, [bytes of each rank's optimizer shard]) of a 2-rank gloo run."""
    out = tempfile.mkdtemp(prefix="loom-bench-muon-")
    try:
        benchlib._port[0] += 1
        args = [benchlib.LAUNCH, "--nproc-per-node", "2", "--master-port", str(benchlib._port[0]),
                benchlib.LOOM, "run", JOB]
        for s in [*sets, f"zero.stage={stage}", "train.save_final=true",
                  f"train.output_dir={out}"]:
            args += ["--set", s]
        subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
        import json
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
        final = sorted(glob.glob(os.path.join(out, "checkpoint-*")))[-1]
        shards = [os.path.getsize(p) for p in
                  sorted(glob.glob(os.path.join(final, "optimizer-*-of-*.safetensors")))]
        return step_time(rows), shards
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="steps per run, small model")
    parser.add_argument("--big-steps", type=int, default=3, help="steps per run, 768x12")
    args = parser.parse_args()
    print(f"CPU: {benchlib.cpu_name()}, {os.cpu_count()} cores; load average "
          f"{os.getloadavg()[0]:.1f} at the start")
    times = {}
    for _ in range(args.rounds):
        for model, model_sets in MODELS.items():
            steps = args.steps if model.startswith("demo") else args.big_steps
            for rule, rule_sets in RULES.items():
                rows = benchlib.run_loom(JOB, [*model_sets, *rule_sets, f"train.max_steps={steps}",
                                               "train.log_level=\"warn\""])
                times.setdefault((model, rule), []).append(step_time(rows))
    print("| model | rule | step (s), median of rounds | per round | vs adamw |")
    print("|---|---|---|---|---|")
    for model in MODELS:
        base = statistics.median(times[(model, "adamw")])
        for rule in RULES:
            t = statistics.median(times[(model, rule)])
            rounds = ", ".join(f"{x:.3f}" for x in times[(model, rule)])
            print(f"| {model} | {rule} | {t:.3f} | {rounds} | {t / base:.2f}x |")
    print()
    print("| stage | rule | step (s) | optimizer shard rank 0 / rank 1 (KiB) | larger / mean |")
    print("|---|---|---|---|---|")
    small = MODELS["demo 128x4"]
    for stage in (1, 2):
        for rule, rule_sets in RULES.items():
            t, shards = zero_run([*small, *rule_sets, f"train.max_steps={args.steps}",
                                  "train.log_level=\"warn\"",
                                  "train.per_device_train_batch_size=8"], stage)
            kib = " / ".join(f"{s / 1024:.0f}" for s in shards)
            print(f"| {stage} | {rule} | {t:.3f} | {kib} | "
                  f"{max(shards) / statistics.mean(shards):.2f} |")


if __name__ == "__main__":
    main()
