"""bf16 optimizer state against fp32 state on the demo job (examples/demo.toml, 300 steps): the
model-state bytes per parameter (run.json's model_state, which the log's `model gpt:` line
rounds) and the loss curve (a few steps, the mean of the last 20, the held-out eval_loss) of
each run, with fp32 weights and with full_bf16 weights, the latter with fp32 masters and without
([optimizer] master_dtype = "bf16": the bf16 weights updated with stochastic rounding). One run
per configuration, one after another; the same seed, so the runs differ only by what the
configuration changes. Not a test.

usage: .venv/bin/python examples/bench/bf16_state/run.py [--steps N] [--write]
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import benchlib  # noqa: E402

FULL = 'precision.mode="full_bf16"'
BF16_STATE = 'optimizer.state_dtype="bf16"'
NO_MASTERS = 'optimizer.master_dtype="bf16"'
# (weights, masters, state, --set lines)
CONFIGS = [
    ("fp32", "none (fp32 weights)", "fp32", []),
    ("fp32", "none (fp32 weights)", "bf16", [BF16_STATE]),
    ("full_bf16", "fp32", "fp32", [FULL]),
    ("full_bf16", "fp32", "bf16", [FULL, BF16_STATE]),
    ("full_bf16", "none (stochastic rounding)", "fp32", [FULL, NO_MASTERS]),
    ("full_bf16", "none (stochastic rounding)", "bf16", [FULL, BF16_STATE, NO_MASTERS]),
]
SHOWN = [1, 50, 100, 200, 300]


def run(sets, steps):
    out = tempfile.mkdtemp(prefix="loom-bench-bf16-")
    try:
        sets = [*sets, f"train.max_steps={steps}", "train.save_steps=0", "train.progress_bar=false",
                f'train.output_dir="{out}"']
        cmd = [benchlib.LOOM, "run", os.path.join(benchlib.ROOT, "examples/demo.toml")]
        cmd += [x for s in sets for x in ("--set", s)]
        began = time.time()
        log = subprocess.run(cmd, check=True, capture_output=True, text=True)
        seconds = time.time() - began
        text = log.stdout + log.stderr
        model = re.search(r"model gpt: (.*)", text).group(1)
        # The exact bytes of the model state, from run.json (the log rounds them).
        with open(os.path.join(out, "run.json")) as f:
            state = json.load(f)["model_state"]
        per_param = {key: state[key] / state["trainable_params"] for key in (
            "param_bytes", "master_bytes", "grad_bytes", "optimizer_bytes")}
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        return model, per_param, rows, seconds
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    shown = [s for s in SHOWN if s <= args.steps]
    lines = [
        f"demo job (examples/demo.toml: GPT 4 x 128, 0.84 M parameters, batch 16 x 128 bytes), "
        f"{args.steps} steps, seed 42, one run each. Machine: {benchlib.cpu_name()}, "
        f"{os.cpu_count()} cores.",
        "",
        "| weights | masters | state | model state B/param (weights + masters + grads + state) | "
        + " | ".join(f"loss @{s}" for s in shown)
        + " | mean loss, last 20 | eval_loss @100/200/300 |",
        "|---|---|---|---|" + "---|" * len(shown) + "---|---|",
    ]
    for weights, masters, state, sets in CONFIGS:
        model, per_param, rows, seconds = run(sets, args.steps)
        train = {r["step"]: r["loss"] for r in rows if "loss" in r}
        evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
        last = [train[s] for s in sorted(train)[-20:]]
        parts = list(per_param.values())
        anatomy = " + ".join(f"{p:g}" for p in parts) + f" = {sum(parts):g}"
        lines.append(f"| {weights} | {masters} | {state} | {anatomy} | "
                     + " | ".join(f"{train[s]:.4f}" for s in shown)
                     + f" | {sum(last) / len(last):.4f} | "
                     + " / ".join(f"{e:.4f}" for e in evals) + " |")
        print(lines[-1], f"\n   {seconds:.0f} s;", model, flush=True)
    lines += ["", "Command: `.venv/bin/python examples/bench/bf16_state/run.py --write`"]
    text = "\n".join(lines)
    print(text)
    if args.write:
        benchlib.write_section("bf16_state", text)


if __name__ == "__main__":
    main()
