"""Preload benchmark: the step time of a small gpt whose samples cost as much to prepare as the
step computes, with preparation on the training thread (0 workers) and on N worker threads,
against the compute-only step (no preparation cost). Runs are interleaved over rounds; each
reports the median step time after a warm-up.
usage: .venv/bin/python examples/bench/preload/run.py [--rounds 3] [--steps 30] [--workers 4]
       [--build build] [--cost-us N]"""
import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
HERE = os.path.dirname(os.path.abspath(__file__))


def run(args, cost_us, preload):
    out = tempfile.mkdtemp(prefix="loom-bench-preload-")
    job = os.path.join(out, "job.toml")
    with open(os.path.join(HERE, "gpt_small.toml")) as f:
        text = f.read()
    if preload is not None:
        text += f"\n[preload]\n{preload}\n"
    with open(job, "w") as f:
        f.write(text)
    cmd = [os.path.join(ROOT, args.build, "bin/loom"), "run", job]
    for s in [f"train.max_steps={args.steps}", f"train.output_dir={out}/run",
              f"data.sample_cost_us={cost_us}"]:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True)
    with open(os.path.join(out, "run", "metrics.jsonl")) as f:
        times = [json.loads(line)["step_time_s"] for line in f]
    shutil.rmtree(out, ignore_errors=True)
    return statistics.median(times[args.warmup:])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--build", default="build")
    p.add_argument("--cost-us", type=int, default=0, help="per-sample cost (0 = calibrate)")
    args = p.parse_args()
    batch = 8
    # Preparation cost = the compute: per-sample cost = compute step time / batch. The fastest
    # of three calibration runs, since a busy machine only ever slows a run down.
    cost_us = args.cost_us or int(min(run(args, 0, None) for _ in range(3)) * 1e6 / batch)
    configs = {"compute only (no preparation cost)": (0, None),
               "preparation on the training thread (no [preload])": (cost_us, None),
               "[preload] num_workers = 0": (cost_us, "num_workers = 0"),
               f"[preload] num_workers = {args.workers}": (cost_us, f"num_workers = {args.workers}")}
    results = {name: [] for name in configs}
    names = list(configs)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            results[name].append(run(args, *configs[name]))
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"gpt 4x128, batch {batch} x 128 tokens; preparation {cost_us} us/sample = "
          f"{cost_us * batch / 1e3:.1f} ms/batch; {args.rounds} rounds x {args.steps} steps "
          f"(median after {args.warmup})")
    base = statistics.median(results[names[0]])
    print("| configuration | step time (ms) | vs compute only |")
    print("|---|---|---|")
    for name in names:
        t = statistics.median(results[name])
        print(f"| {name} | {1e3 * t:.1f} | {100 * (t / base - 1):+.1f} % |")


if __name__ == "__main__":
    main()
