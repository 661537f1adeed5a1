#!/usr/bin/env python3
"""Peak memory and step time of fp32 vs bf16 vs fp16 training of a scaled-down `bert`.

Reproduces the seed table "batch size / w/o fp16 / w/ fp16 / savings": for each batch size it
runs `loom run` once per precision mode, interleaved (batch sizes and modes alternate within each
repeat, so a slow spell of a shared machine hits every column), and reports medians over the
repeats. Memory is the tracked CPU allocator's peak (metrics.jsonl mem_peak_bytes: every tensor
byte LibTorch allocated, nothing else) and the process's peak RSS (rss_peak_bytes). Not a test.

    .venv/bin/python examples/bench/precision/bench_precision.py [--loom build/bin/loom]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchlib import cpu_name  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# BERT-base's proportions (hidden = 64 * heads, intermediate = 4 * hidden, its vocabulary),
# scaled down to 4 layers of width 256 so the whole run takes minutes on 2 cores.
JOB = """
[train]
model = "bert"
max_steps = {steps}
per_device_train_batch_size = {batch}
learning_rate = 5e-5
seed = 42
output_dir = "{out}"
progress_bar = false
log_level = "warn"
save_final = false
num_threads = {threads}

[model]
vocab_size = 30522
hidden_size = 256
num_hidden_layers = 4
num_attention_heads = 4
intermediate_size = 1024
max_position_embeddings = 512
num_labels = 2

[data]
source = "random_tokens"
task = "classification"
num_samples = 4096
seq_len = {seq_len}
vocab_low = 100
vocab_high = 30000

[precision]
mode = "{mode}"
"""


def run_once(loom, mode, batch, args):
    with tempfile.TemporaryDirectory(prefix="loom-bench-precision-") as tmp:
        job = os.path.join(tmp, "job.toml")
        with open(job, "w") as f:
            f.write(JOB.format(steps=args.steps, batch=batch, out=os.path.join(tmp, "run"),
                               threads=args.threads, seq_len=args.seq_len, mode=mode))
        done = subprocess.run([loom, "run", job], capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"loom failed for mode={mode} batch={batch}:\n{done.stderr}")
        with open(os.path.join(tmp, "run", "metrics.jsonl")) as f:
            lines = [json.loads(line) for line in f if line.strip()]
    # Step 1 builds the optimizer state and warms caches: time the steps after it.
    times = [line["step_time_s"] for line in lines[1:]] or [lines[0]["step_time_s"]]
    return {"mem_peak": lines[-1]["mem_peak_bytes"], "rss_peak": lines[-1]["rss_peak_bytes"],
            "step_s": statistics.median(times)}


def mib(n):
    return n / 2**20


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loom", default=os.path.join(ROOT, "build", "bin", "loom"))
    parser.add_argument("--modes", default="fp32,bf16,fp16")
    parser.add_argument("--batches", default="8,16,32,64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="steps per run (the first is not timed)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0 = all cores)")
    args = parser.parse_args()
    modes = args.modes.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    results = {(m, b): [] for m in modes for b in batches}

    start = time.time()
    for repeat in range(args.repeats):
        # Interleave: every repeat visits every (batch, mode); the mode order rotates.
        for batch in batches:
            order = modes[repeat % len(modes):] + modes[:repeat % len(modes)]
            for mode in order:
                r = run_once(args.loom, mode, batch, args)
                results[(mode, batch)].append(r)
                print(f"repeat {repeat + 1} batch {batch:3d} {mode:9s} peak {mib(r['mem_peak']):8.1f} MiB "
                      f"rss {mib(r['rss_peak']):8.1f} MiB step {r['step_s']:.3f} s", file=sys.stderr)

    def med(mode, batch, key):
        return statistics.median(r[key] for r in results[(mode, batch)])

    cpu = cpu_name()
    print(f"machine: {cpu}, {os.cpu_count()} cores; {args.repeats} repeats, medians; "
          f"bert 4x256 (heads 4, ffn 1024, vocab 30522), seq_len {args.seq_len}, AdamW; "
          f"wall {time.time() - start:.0f} s\n")
    base = modes[0]
    header = "| batch | " + " | ".join(f"{m} peak MiB" for m in modes)
    header += " | " + " | ".join(f"{m} saving MiB" for m in modes[1:])
    header += " | " + " | ".join(f"{m} RSS MiB" for m in modes)
    header += " | " + " | ".join(f"{m} step s" for m in modes) + " |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for batch in batches:
        peaks = [med(m, batch, "mem_peak") for m in modes]
        cells = [f"{mib(p):.1f}" for p in peaks]
        cells += [f"{mib(peaks[0] - p):+.1f}" for p in peaks[1:]]
        cells += [f"{mib(med(m, batch, 'rss_peak')):.0f}" for m in modes]
        cells += [f"{med(m, batch, 'step_s'):.3f}" for m in modes]
        print(f"| {batch} | " + " | ".join(cells) + " |")
    print(f"\nsaving = {base} peak - mode peak (tracked allocator); positive = the mode uses less")


if __name__ == "__main__":
    main()
