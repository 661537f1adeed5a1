"""LoRA benchmark: a full fine-tune and a LoRA fine-tune (r 8 on every Linear of each block) of
gpt at GPT-2 124M size, interleaved over several rounds. Reports the model state the engine
accounts (weights, grads, optimizer state), the tracked allocator's bytes held after a step,
and the median step time. Goal (issue 8): grad + optimizer bytes shrink by at least
(1 - trainable fraction), within 5 %.
usage: .venv/bin/python examples/bench/lora/run.py [--rounds 3] [--steps 4] [--batch 2]
       [--seq 128] [--r 8] [--build build]"""
import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
HERE = os.path.dirname(os.path.abspath(__file__))
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def size(text):
    value, unit = text.split()
    return float(value) * UNITS[unit]


def run(args, lora):
    out = tempfile.mkdtemp(prefix="loom-bench-lora-")
    job = os.path.join(out, "job.toml")
    with open(os.path.join(HERE, "gpt2.toml")) as f:
        text = f.read()
    if lora:
        text += (f'\n[lora]\nr = {args.r}\nlora_alpha = {2 * args.r}\n'
                 'target_modules = ["qkv", "proj", "fc_in", "fc_out"]\nsave_adapter = false\n')
    with open(job, "w") as f:
        f.write(text)
    cmd = [os.path.join(ROOT, args.build, "bin/loom"), "run", job]
    for s in [f"train.max_steps={args.steps}", f"train.output_dir={out}/run",
              f"data.seq_len={args.seq}", f"train.per_device_train_batch_size={args.batch}"]:
        cmd += ["--set", s]
    log = subprocess.run(cmd, check=True, capture_output=True, text=True).stderr
    state = re.search(r"params (\d+) \((\d+) trainable\): weights ([\d.]+ \w+) .*?grads ([\d.]+ \w+), "
                      r"optimizer state ([\d.]+ \w+)", log + "")
    if not state:
        raise SystemExit("no model-state line in the log:\n" + log)
    with open(os.path.join(out, "run", "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    shutil.rmtree(out, ignore_errors=True)
    steady = lines[1:]  # the first step also allocates grads and AdamW's state
    return {"params": int(state[1]), "trainable": int(state[2]), "weights": size(state[3]),
            "grads": size(state[4]), "optimizer": size(state[5]),
            "held": lines[-1]["mem_current_bytes"],
            "step": statistics.median(l["step_time_s"] for l in steady)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--r", type=int, default=8)
    p.add_argument("--build", default="build")
    args = p.parse_args()
    mib = 1 << 20
    results = {"full": [], "lora": []}
    for r in range(args.rounds):
        for name in (["full", "lora"] if r % 2 == 0 else ["lora", "full"]):  # alternate who goes first
            results[name].append(run(args, name == "lora"))
    med = {name: {k: statistics.median(x[k] for x in rows) for k in rows[0]}
           for name, rows in results.items()}
    full, lora = med["full"], med["lora"]
    fraction = lora["trainable"] / lora["params"]
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared); "
          f"gpt 124M (12 x 768), batch {args.batch} x seq {args.seq}, LoRA r {args.r} on qkv, proj, "
          f"fc_in, fc_out; medians of {args.rounds} rounds x {args.steps} steps (step 1 excluded)")
    print("| run | trainable params | weights (MiB) | grads (MiB) | optimizer state (MiB) | "
          "grads + optimizer (MiB) | held after a step (MiB) | step time (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, m in med.items():
        print(f"| {name} | {m['trainable']:,.0f} ({100 * m['trainable'] / m['params']:.2f} %) | "
              f"{m['weights'] / mib:.1f} | {m['grads'] / mib:.2f} | {m['optimizer'] / mib:.2f} | "
              f"{(m['grads'] + m['optimizer']) / mib:.2f} | {m['held'] / mib:.1f} | {m['step']:.3f} |")
    reduction = 1 - (lora["grads"] + lora["optimizer"]) / (full["grads"] + full["optimizer"])
    goal = 1 - fraction
    print(f"\ngrad + optimizer bytes reduced by {100 * reduction:.2f} %; goal (1 - trainable fraction "
          f"{fraction:.4f}) = {100 * goal:.2f} % within 5 % -> {'met' if reduction >= goal * 0.95 else 'NOT met'}; "
          f"step time {full['step'] / lora['step']:.2f}x faster with LoRA")


if __name__ == "__main__":
    main()
