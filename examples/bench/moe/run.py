"""MoE benchmark, two parts.

1. Speed and memory: an 8-expert top-2 MoE GPT (an MoE layer in every 2nd block, as Switch)
   beside the dense GPT with equal *active* parameters per token (each MoE block's FeedForward
   twice as wide: top-2 runs two experts) and the dense GPT with equal *total* parameters (each
   MoE block's FeedForward eight times as wide). The runs are interleaved over several rounds;
   reports the median tokens/s of the steady steps and the tracked allocator's peak.
2. Load balance: the demo job (English text) with 8-expert top-2 layers for --balance-steps
   steps, with the load-balancing loss (alpha 0.01) and without it; reports the busiest expert's
   load over the mean (1 = balanced) and the dropped fraction, at the end and along the way.

usage: .venv/bin/python examples/bench/moe/run.py [--rounds 3] [--steps 6] [--balance-steps 200]
       [--build build]"""
import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))

GPT = """[train]
model = "gpt"
per_device_train_batch_size = 8
learning_rate = 1e-3
logging_steps = 1000
progress_bar = false
log_level = "warn"
save_final = false

[model]
vocab_size = 256
n_positions = 128
n_embd = 256
n_layer = 4
n_head = 4
dropout = 0.0
{inner}

[data]
source = "random_tokens"
task = "lm"
num_samples = 4096
seq_len = 128
vocab_low = 0
vocab_high = 256

[optimizer]
name = "adamw"
"""
MOE = "\n[moe]\nnum_experts = 8\ntop_k = 2\nmoe_every = 2\ncapacity_factor = 1.25\n"


def loom(job_text, sets, out):
    os.makedirs(out, exist_ok=True)
    job = os.path.join(out, "job.toml")
    with open(job, "w") as f:
        f.write(job_text)
    cmd = [os.path.join(ROOT, ARGS.build, "bin/loom"), "run", job,
           "--set", f"train.output_dir={out}/run"]
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True)
    with open(os.path.join(out, "run", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def speed(kind):
    # The dense FeedForward is 4·C wide; only every 2nd block has experts, so "equal" widths
    # apply to every block of the dense models (the others stay 4·C in the MoE model: the
    # widths below are per-block averages rounded to the nearest multiple of 64).
    c = 256
    if kind == "moe":
        text = GPT.format(inner="") + MOE
    elif kind == "dense, equal active":
        text = GPT.format(inner=f"n_inner = {(4 * c + 2 * 4 * c) // 2}")
    else:
        text = GPT.format(inner=f"n_inner = {(4 * c + 8 * 4 * c) // 2}")
    out = tempfile.mkdtemp(prefix="loom-bench-moe-")
    lines = loom(text, [f"train.max_steps={ARGS.steps}"], out)
    shutil.rmtree(out, ignore_errors=True)
    steady = lines[1:]
    tokens = 8 * 128
    return (statistics.median(tokens / l["step_time_s"] for l in steady),
            lines[-1]["mem_peak_bytes"], lines[-1].get("moe_dropped_fraction"))


def balance(aux):
    with open(os.path.join(ROOT, "examples/demo.toml")) as f:
        text = f.read()
    text = text.replace('output_dir = "../runs/demo"\n', "").replace('resume = "latest"\n', "")
    text = text.replace("save_steps = 100", "save_final = false\nprogress_bar = false\n"
                        "log_level = \"warn\"")
    text = text.replace('path = ["', 'path = ["').replace("[optimizer]", MOE.replace(
        "moe_every = 2", "moe_every = 2\naux_loss_coef = " + str(aux)) + "\n[optimizer]")
    out = tempfile.mkdtemp(prefix="loom-bench-moe-balance-")
    lines = loom(text, [f"train.max_steps={ARGS.balance_steps}"], out)
    shutil.rmtree(out, ignore_errors=True)
    def at(i):
        window = lines[max(0, i - 9):i + 1]  # the mean of 10 steps
        return (statistics.mean(l["moe_load_max_over_mean"] for l in window),
                statistics.mean(l["moe_dropped_fraction"] for l in window),
                statistics.mean(l["loss"] for l in window))
    return [(i + 1, *at(i)) for i in (9, len(lines) // 2 - 1, len(lines) - 1)]


def main():
    global ARGS
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--balance-steps", type=int, default=200)
    p.add_argument("--build", default="build")
    p.add_argument("--skip-speed", action="store_true")
    ARGS = p.parse_args()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if "model name" in l),
               platform.machine())
    print(f"machine: {cpu}, {os.cpu_count()} cores")
    if not ARGS.skip_speed:
        kinds = ["moe", "dense, equal active", "dense, equal total"]
        results = {k: [] for k in kinds}
        for _ in range(ARGS.rounds):
            for k in kinds:
                results[k].append(speed(k))
        print("| model | tokens/s (median) | vs MoE | peak memory |")
        print("|---|---|---|---|")
        moe_speed = statistics.median(r[0] for r in results["moe"])
        for k in kinds:
            s = statistics.median(r[0] for r in results[k])
            peak = max(r[1] for r in results[k])
            print(f"| {k} | {s:.0f} | {s / moe_speed:.2f}x | {peak / 2**20:.0f} MiB |")
    print("| balancing loss | step | max/mean expert load | dropped | loss |")
    print("|---|---|---|---|---|")
    for aux in (0.01, 0.0):
        for step, load, dropped, loss in balance(aux):
            print(f"| alpha {aux} | {step} | {load:.3f} | {dropped:.3f} | {loss:.3f} |")


if __name__ == "__main__":
    main()
