"""The efficient-training table of the seed guide ("How To Fit a Bigger Model and Train It
Faster"), reproduced by loom: a BERT classifier on random sequences, nine configurations, each
a job file run by `loom run`; prints time, samples/s, peak memory (tracked allocator and RSS)
and the model-state breakdown, and draws a PNG chart.

Default: a scaled BERT that fits a 2-core CPU in a few minutes (stated in the output).
--full: BERT-large (24 x 1024, 16 heads, 4096), 512 sequences of 512 tokens, as the seed.
On CPU, half precision is bf16 (fp16 autocast has no fast CPU kernels); --half fp16 forces the
seed's fp16, which a CUDA build would use.
usage: .venv/bin/python examples/bench/seed_table/run.py [--full | --tiny] [--write] [--chart F]"""
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

SHAPES = {
    # name: (hidden, layers, heads, intermediate, seq_len, samples)
    "tiny": (64, 2, 2, 128, 32, 16),
    "scaled": (256, 4, 4, 1024, 512, 32),
    "full": (1024, 24, 16, 4096, 512, 512),
}

# The seed's rows: (label, batch, accumulation, checkpointing, half, optimizer)
ROWS = [
    ("vanilla, batch 4", 4, 1, False, False, "adamw"),
    ("batch 1 x accumulation 4", 1, 4, False, False, "adamw"),
    ("+ gradient checkpointing", 1, 4, True, False, "adamw"),
    ("{half}, batch 4", 4, 1, False, True, "adamw"),
    ("batch 1 x accum 4 + checkpointing + {half}", 1, 4, True, True, "adamw"),
    ("adafactor, batch 4", 4, 1, False, False, "adafactor"),
    ("adafactor + accum + checkpointing + {half}", 1, 4, True, True, "adafactor"),
    ("8-bit Adam, batch 4", 4, 1, False, False, "adam8bit"),
    ("8-bit Adam + accum + checkpointing + {half}", 1, 4, True, True, "adam8bit"),
]

SEED = [  # V100 numbers of the seed table: time (s), samples/s, memory (MB)
    (57.82, 8.86, 14949), (66.03, 7.75, 8681), (85.47, 5.99, 6775), (27.46, 18.64, 13939),
    (50.76, 10.09, 7275), (64.31, 7.96, 12295), (56.54, 9.06, 4847), (55.95, 9.15, 13085),
    (49.46, 10.35, 5363)]


def job_text(shape, row, half_mode, out, threads):
    hidden, layers, heads, inter, seq, samples = shape
    label, batch, accum, ckpt, half, opt = row
    steps = samples // (batch * accum)
    lines = [
        "[train]", 'model = "bert"', f"max_steps = {steps}",
        f"per_device_train_batch_size = {batch}", f"gradient_accumulation_steps = {accum}",
        "learning_rate = 5e-5", "save_final = false", "progress_bar = false",
        'log_level = "warn"', f'output_dir = "{out}"', f"num_threads = {threads}",
        "[model]", f"hidden_size = {hidden}", f"num_hidden_layers = {layers}",
        f"num_attention_heads = {heads}", f"intermediate_size = {inter}",
        f"max_position_embeddings = {max(512, seq)}",
        "[data]", 'source = "random_tokens"', f"num_samples = {samples}", f"seq_len = {seq}",
        'task = "classification"', "shuffle = false",
        "[optimizer]", f'name = "{opt}"']
    if opt == "adafactor":  # the Trainer's optim="adafactor": the job's lr, no relative step
        lines += ["scale_parameter = false", "relative_step = false"]
    if ckpt:
        lines += ["[checkpointing]"]
    if half:
        lines += ["[precision]", f'mode = "{half_mode}"']
    return "\n".join(lines) + "\n"


def run_row(loom, shape, row, half_mode, threads):
    out = tempfile.mkdtemp(prefix="loom-seed-")
    job = os.path.join(out, "job.toml")
    with open(job, "w") as f:
        f.write(job_text(shape, row, half_mode, os.path.join(out, "run"), threads))
    subprocess.run([loom, "run", job], check=True)
    rows = [json.loads(l) for l in open(os.path.join(out, "run", "metrics.jsonl"))]
    info = json.load(open(os.path.join(out, "run", "run.json")))
    shutil.rmtree(out, ignore_errors=True)
    seconds = sum(r["step_time_s"] for r in rows)
    samples = shape[5]
    return {
        "device": info["device"],
        "time": seconds, "samples_per_s": samples / seconds,
        "peak": max(r["mem_peak_bytes"] for r in rows),
        "rss": max(r["rss_peak_bytes"] for r in rows),
        "state": info["model_state"],
    }


def cpu_kernels(loom):
    """The oneDNN kernel level loom runs with here (its CPU probe), from `loom --version`."""
    out = subprocess.run([loom, "--version"], capture_output=True, text=True).stdout
    line = next((l for l in out.splitlines() if "oneDNN isa" in l), "")
    return "oneDNN isa " + line.split("oneDNN isa", 1)[1].split("(loom env")[0].strip() if line else "?"


def gpu_name():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                             capture_output=True, text=True, check=True).stdout.strip()
        return out or "CUDA GPU"
    except (OSError, subprocess.CalledProcessError):
        return "CUDA GPU"


def mib(b):
    return b / 2**20


def main():
    p = argparse.ArgumentParser()
    g = p.add_mutually_exclusive_group()
    g.add_argument("--full", action="store_true", help="BERT-large, 512 x 512, as the seed")
    g.add_argument("--tiny", action="store_true", help="a seconds-long run (the test uses it)")
    p.add_argument("--half", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="runs per row; medians reported")
    p.add_argument("--loom", default=os.path.join(ROOT, "build/bin/loom"))
    p.add_argument("--chart", default=None, help="PNG path (default: docs/seed_table.png with --write)")
    p.add_argument("--write", action="store_true", help="update docs/BENCHMARKS.md and the chart")
    p.add_argument("--json", default=None, help="also write the table and raw numbers here")
    p.add_argument("--rows", default=None, help="only these rows, 1-based, e.g. 6,7,8,9")
    a = p.parse_args()
    shape_name = "full" if a.full else "tiny" if a.tiny else "scaled"
    shape = SHAPES[shape_name]
    rows = ROWS if not a.rows else [ROWS[int(i) - 1] for i in a.rows.split(",")]
    seeds = SEED if not a.rows else [SEED[int(i) - 1] for i in a.rows.split(",")]
    results = []
    for row in rows:
        runs = [run_row(a.loom, shape, row, a.half, a.threads) for _ in range(a.repeats)]
        res = {k: statistics.median(r[k] for r in runs) for k in ("time", "samples_per_s", "peak", "rss")}
        res["state"] = runs[0]["state"]
        res["device"] = runs[0]["device"]
        results.append(res)
        print(f"{row[0].format(half=a.half)}: {res['time']:.2f} s, {mib(res['peak']):.0f} MiB",
              file=sys.stderr)
    hidden, layers, heads, inter, seq, samples = shape
    on_gpu = results[0]["device"].startswith("cuda")
    where = (f"one {gpu_name()}; memory = peak bytes of the CUDA caching allocator"
             if on_gpu else f"{cpu_name()} ({cpu_kernels(a.loom)}); memory = peak bytes of "
             f"loom's tracking CPU allocator")
    header = (f"BERT classifier, {layers} layers x {hidden} wide, {heads} heads, intermediate "
              f"{inter}, {samples} random sequences of {seq} tokens ({shape_name} size); half "
              f"precision = {a.half}; {where} (RSS beside it); {a.repeats} run(s) per row.")
    lines = ["| configuration | time (s) | samples/s | memory (MiB) | peak RSS (MiB) | weights | grads | optimizer | activations + other | seed: time / samples/s / MB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row, res, seed in zip(rows, results, seeds):
        st = res["state"]
        fixed = st["param_bytes"] + st["master_bytes"] + st["grad_bytes"] + st["optimizer_bytes"]
        lines.append(
            f"| {row[0].format(half=a.half)} | {res['time']:.2f} | {res['samples_per_s']:.2f} | "
            f"{mib(res['peak']):.1f} | {mib(res['rss']):.0f} | {mib(st['param_bytes'] + st['master_bytes']):.1f} | "
            f"{mib(st['grad_bytes']):.1f} | {mib(st['optimizer_bytes']):.1f} | "
            f"{mib(max(0, res['peak'] - fixed)):.1f} | {seed[0]} / {seed[1]} / {seed[2]} |")
    best = min(r["peak"] for r in results)
    ratio = results[0]["peak"] / best
    summary = (f"vanilla / best combined memory: {ratio:.2f}x (seed: {14949 / 4847:.2f}x)")
    table = "\n".join([header, "", *lines, "", summary])
    print(table)
    chart = a.chart or (os.path.join(ROOT, "docs/seed_table.png") if a.write else None)
    if chart:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            labels = [r[0].format(half=a.half) for r in rows]
            fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5), sharey=True)
            left.barh(labels, [mib(r["peak"]) for r in results], color="#4c72b0")
            left.set_xlabel("peak memory (MiB)")
            left.invert_yaxis()
            right.barh(labels, [r["samples_per_s"] for r in results], color="#dd8452")
            right.set_xlabel("samples / s")
            fig.suptitle(f"loom, BERT {layers}x{hidden}, seq {seq}: memory and throughput per technique")
            fig.tight_layout()
            fig.savefig(chart, dpi=110)
            print(f"chart: {chart}", file=sys.stderr)
        except ImportError:
            print("matplotlib is not installed: no chart (scripts/setup installs it)", file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"table": table, "rows": results}, f, indent=1)
    if a.write:
        cmd = ("`.venv/bin/python examples/bench/seed_table/run.py"
               + (f" --repeats {a.repeats}" if a.repeats != 1 else "") + " --write"
               + (" --full" if a.full else "") + "`")
        write_section("seed_table", table + "\n\nCommand: " + cmd + "\n\n![seed table](seed_table.png)")


if __name__ == "__main__":
    main()
