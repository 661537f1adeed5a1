"""The offloaded update against its parts: a 0.2 B-parameter GPT (bf16 weights, AdamW; fp32
masters and state on NVMe: 2.4 GB read and written per step) trained a few steps with DeepSpeed's
defaults (4 buffers, queue depth 8) and with 8 buffers and queue depth 16. Each step's metrics give the update's wall time, the rule's compute time and the time
spent waiting for I/O; `loom_nvme_bench` at the same block size and queue depth, in the same
run, gives the time the same bytes take to read and then write with nothing else running (the
I/O alone). Goal: update <= 1.2 x max(I/O alone, compute). Also the peak RSS of the same job
with the state in memory.
usage: .venv/bin/python examples/bench/offload/update.py FOLDER [--steps 4] [--build build]"""
import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt_bf16.toml")


def run(args, offload):
    out = tempfile.mkdtemp(prefix="loom-bench-offload-")
    sets = [f"train.output_dir={out}/run", f"train.max_steps={args.steps}"]
    if offload:
        sets.append(f"zero.offload_optimizer={offload}")
    cmd = [os.path.join(ROOT, args.build, "bin/loom"), "run", JOB]
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True)
    with open(os.path.join(out, "run", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def io_alone(args, qd, gib):
    out = subprocess.run([os.path.join(ROOT, args.build, "bin/loom_nvme_bench"), args.folder,
                          "--gib", str(gib), "--queue-depth", str(qd), "--rounds", "2"],
                         check=True, capture_output=True, text=True).stdout
    found = dict(re.findall(r"round 2 (write|read) (\d+) MiB/s", out))
    return float(found["write"]), float(found["read"])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("folder")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--build", default="build")
    args = p.parse_args()
    print("| buffers, queue depth | update s | compute s | I/O wait s | I/O alone s | update / max(I/O, compute) |")
    print("|---|---|---|---|---|---|")
    for buffers, qd in ((4, 8), (8, 16)):
        lines = run(args, f'{{ device = "nvme", nvme_path = "{args.folder}", '
                          f'buffer_count = {buffers}, queue_depth = {qd} }}')[1:]
        update = statistics.median(l["offload_update_s"] for l in lines)
        compute = statistics.median(l["offload_compute_s"] for l in lines)
        wait = statistics.median(l["offload_io_wait_s"] for l in lines)
        read_bytes, write_bytes = lines[-1]["offload_bytes_read"], lines[-1]["offload_bytes_written"]
        write_bw, read_bw = io_alone(args, qd, 2)
        alone = read_bytes / 2**20 / read_bw + write_bytes / 2**20 / write_bw
        print(f"| {buffers}, {qd} | {update:.2f} | {compute:.2f} | {wait:.2f} | {alone:.2f} "
              f"(read {read_bw:.0f}, write {write_bw:.0f} MiB/s) | {update / max(alone, compute):.2f} |")
        rss_off = max(l["rss_peak_bytes"] for l in lines)
    rss_mem = max(l["rss_peak_bytes"] for l in run(args, None))
    print(f"peak RSS: {rss_off / 2**30:.2f} GiB offloaded, {rss_mem / 2**30:.2f} GiB in memory")


if __name__ == "__main__":
    main()
