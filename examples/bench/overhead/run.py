"""loom's overhead benchmark: the same GPT-2-style model and batch trained by (a) loom,
(b) a hand-written raw LibTorch loop, (c) a plain Python PyTorch loop, interleaved, several
rounds; reports the median step time of each and writes the table into docs/BENCHMARKS.md.
usage: .venv/bin/python examples/bench/overhead/run.py [--rounds 5] [--steps 30] [--write]"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchlib import cpu_name, write_section  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
HERE = os.path.dirname(os.path.abspath(__file__))


def run_loom(args, shape, out):
    shutil.rmtree(out, ignore_errors=True)
    sets = [f"train.max_steps={args.steps}", f"train.per_device_train_batch_size={shape['batch']}",
            f"train.num_threads={args.threads}", f"train.output_dir={out}",
            f"model.n_layer={shape['layers']}", f"model.n_embd={shape['embd']}",
            f"model.n_head={shape['heads']}", f"model.n_positions={shape['seq']}",
            f"data.seq_len={shape['seq']}"]
    cmd = [os.path.join(ROOT, "build/bin/loom"), "run", os.path.join(HERE, "gpt_bench.toml")]
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line)["step_time_s"] for line in f]


def run_lines(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return [float(line.split()[0]) for line in out.splitlines()]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--write", action="store_true", help="update docs/BENCHMARKS.md")
    args = p.parse_args()
    shape = dict(batch=8, seq=128, layers=4, embd=256, heads=4, vocab=256)
    positional = [str(args.steps), str(shape["batch"]), str(shape["seq"]), str(shape["layers"]),
                  str(shape["embd"]), str(shape["heads"]), str(shape["vocab"]), str(args.threads)]
    impls = {
        "loom": lambda: run_loom(args, shape, tempfile.mkdtemp(prefix="loom-bench-")),
        "raw LibTorch loop": lambda: run_lines([os.path.join(ROOT, "build/bin/loom_bench_raw_loop")] + positional),
        "Python PyTorch loop": lambda: run_lines([sys.executable, os.path.join(HERE, "python_loop.py")] + positional),
    }
    medians = {name: [] for name in impls}
    for r in range(args.rounds):
        order = list(impls)[r % 3:] + list(impls)[:r % 3]  # rotate who goes first
        for name in order:
            times = impls[name]()[args.warmup:]
            medians[name].append(statistics.median(times))
            print(f"round {r + 1} {name}: {medians[name][-1] * 1000:.1f} ms/step", file=sys.stderr)
    tokens = shape["batch"] * shape["seq"]
    raw = statistics.median(medians["raw LibTorch loop"])
    python = statistics.median(medians["Python PyTorch loop"])
    rows = []
    for name, values in medians.items():
        m = statistics.median(values)
        rows.append(f"| {name} | {m * 1000:.1f} | {tokens / m:,.0f} | {m / raw:.3f} | {python / m:.2f}x |")
    cpu = cpu_name()
    table = "\n".join([
        f"GPT-2-style model, {shape['layers']} layers x {shape['embd']} wide, {shape['heads']} heads, "
        f"vocab {shape['vocab']}, batch {shape['batch']} x {shape['seq']} tokens, AdamW, clip 1.0, "
        f"{args.threads} threads; {args.rounds} interleaved rounds of {args.steps} steps "
        f"(first {args.warmup} dropped), median of the per-round medians. Machine: {cpu}, "
        f"{os.cpu_count()} cores.",
        "",
        "| implementation | step (ms) | tokens/s | time vs raw LibTorch | speed vs Python |",
        "|---|---|---|---|---|",
        *rows,
        "",
        "Command: `.venv/bin/python examples/bench/overhead/run.py --write`",
    ])
    print(table)
    if args.write:
        write_section("overhead", table)


if __name__ == "__main__":
    main()
