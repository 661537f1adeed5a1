"""Checkpointing benchmark: a 12-unit gpt at two sequence lengths, trained without
checkpointing, with every unit and with every 2nd unit checkpointed; the three runs of one
length are interleaved over several rounds. Reports the median step time and the peak of the
tracked allocator; activation memory = peak - the memory held at the end of a step (weights,
grads, AdamW state), which is what checkpointing can cut.
--table policy: the recompute policies instead ([checkpointing] policy = full, attention, mlp,
every_n with every = 2, and full on the first 6, 8 or 10 units with attention on the others),
on GPT-2 124M's shape (n_embd 768, 12 heads, vocab 50257).
usage: .venv/bin/python examples/bench/checkpointing/run.py [--rounds 3] [--steps 4]
       [--seqs 128,256] [--batch 4] [--build build] [--table units|policy] [--only ROW,ROW]"""
import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
HERE = os.path.dirname(os.path.abspath(__file__))
POLICIES = {"none": None, "every unit": "every = 1", "every 2nd unit": "every = 2"}
RECOMPUTE_POLICIES = {"none": None, "full": 'policy = "full"', "attention": 'policy = "attention"',
                      "mlp": 'policy = "mlp"', "every_n (every = 2)": 'policy = "every_n"\nevery = 2'}
# Full on the first N units and attention on the rest ([checkpointing] others): per unit full
# cuts the most and attention costs the least time, so the mix trades along N.
for n in (6, 8, 10):
    RECOMPUTE_POLICIES[f"full x{n} + attention"] = f'policy = "full"\nfirst = {n}\nothers = "attention"'

GPT2_SHAPE = ["model.n_embd=768", "model.n_head=12", "model.vocab_size=50257",
              "data.vocab_high=50257"]


def run(args, seq, policy):
    out = tempfile.mkdtemp(prefix="loom-bench-ckpt-")
    job = os.path.join(out, "job.toml")
    with open(os.path.join(HERE, "gpt12.toml")) as f:
        text = f.read()
    if policy:
        text += f"\n[checkpointing]\n{policy}\n"
    with open(job, "w") as f:
        f.write(text)
    cmd = [os.path.join(ROOT, args.build, "bin/loom"), "run", job]
    for s in [f"train.max_steps={args.steps}", f"train.output_dir={out}/run",
              f"data.seq_len={seq}", f"train.per_device_train_batch_size={args.batch}"] + (
                  GPT2_SHAPE if args.table == "policy" else []):
        cmd += ["--set", s]
    subprocess.run(cmd, check=True)
    with open(os.path.join(out, "run", "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    shutil.rmtree(out, ignore_errors=True)
    steady = lines[1:]  # the first step also allocates AdamW's state
    return (statistics.median(l["step_time_s"] for l in steady), lines[-1]["mem_peak_bytes"],
            lines[-1]["mem_peak_bytes"] - lines[-1]["mem_current_bytes"])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seqs", default="128,256")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--build", default="build")
    p.add_argument("--table", choices=["units", "policy"], default="units")
    p.add_argument("--only", default="",
                   help="comma-separated rows to run (none always runs): a shorter timing run")
    args = p.parse_args()
    policies = RECOMPUTE_POLICIES if args.table == "policy" else POLICIES
    if args.only:
        wanted = {"none", *args.only.split(",")}
        unknown = wanted - set(policies)
        if unknown:
            sys.exit(f"--only: unknown rows {sorted(unknown)}; the rows are {list(policies)}")
        policies = {name: text for name, text in policies.items() if name in wanted}
    mib = 1 << 20
    shape = "GPT-2 124M shape (12 units x 768 wide, 12 heads, vocab 50257)" if (
        args.table == "policy") else "gpt 12 units x 128 wide"
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"{shape}, batch {args.batch}, {args.rounds} rounds x {args.steps} steps")
    print("| seq | policy | step time (s) | vs none | peak (MiB) | activation (MiB) | vs none |")
    print("|---|---|---|---|---|---|---|")
    for seq in [int(s) for s in args.seqs.split(",")]:
        results = {name: [] for name in policies}
        for r in range(args.rounds):
            names = list(policies)
            k = r % len(names)
            for name in names[k:] + names[:k]:  # rotate who goes first
                results[name].append(run(args, seq, policies[name]))
                print(f"round {r}: {name}: {results[name][-1]}", file=sys.stderr, flush=True)
        base_t = statistics.median(x[0] for x in results["none"])
        base_a = statistics.median(x[2] for x in results["none"])
        for name, rows in results.items():
            t = statistics.median(x[0] for x in rows)
            peak = statistics.median(x[1] for x in rows)
            act = statistics.median(x[2] for x in rows)
            print(f"| {seq} | {name} | {t:.3f} | {100 * (t / base_t - 1):+.0f} % | {peak / mib:.0f} "
                  f"| {act / mib:.0f} | {100 * (act / base_a - 1):+.0f} % |", flush=True)


if __name__ == "__main__":
    main()
