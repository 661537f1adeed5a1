"""NVMe swap file throughput beside fio: the same folder, file size, block size and queue
depth, O_DIRECT and io_uring for both; the runs interleaved over several rounds; the medians.
loom's numbers include computing (write) and checking (read) each block's CRC-32C, as in
training; fio moves bytes only. loom's are its second pass over its file (the steady state of a
swap file rewritten every step); fio's file persists across rounds.
Where fio is not installed (a GPU machine's image), `--reference raw` stands in for it:
`loom_nvme_bench --raw`, fio's job written out (io_uring, O_DIRECT, QUEUE_DEPTH requests of
BLOCK_SIZE in flight in file order, no checksum, none of the swap file's code).
usage: .venv/bin/python examples/bench/offload/run.py FOLDER [--gib 2] [--block-size 1048576]
       [--queue-depth 8] [--rounds 5] [--build build] [--reference fio|raw]"""
import argparse
import json
import os
import platform
import re
import statistics
import subprocess

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def fio(args, rw):
    name = os.path.join(args.folder, "fio-bench.bin")
    out = subprocess.run(
        ["fio", "--name=bench", f"--filename={name}", f"--size={args.gib}G",
         f"--bs={args.block_size}", f"--rw={rw}", "--direct=1", "--ioengine=io_uring",
         f"--iodepth={args.queue_depth}", "--output-format=json"],
        check=True, capture_output=True, text=True).stdout
    job = json.loads(out)["jobs"][0]
    return job["write" if rw == "write" else "read"]["bw_bytes"] / 2**20


def fio_both(args):
    """fio's (write, read) MiB/s."""
    return fio(args, "write"), fio(args, "read")


def raw(args):
    """fio's job without fio (`loom_nvme_bench --raw`: io_uring, O_DIRECT, no checksum, none of
    the swap file's code): (write, read) MiB/s of its second round, as fio's file persists
    across rounds."""
    out = subprocess.run(
        [os.path.join(ROOT, args.build, "bin/loom_nvme_bench"), "--raw", args.folder,
         "--gib", str(args.gib), "--block-size", str(args.block_size),
         "--queue-depth", str(args.queue_depth), "--rounds", "2"],
        check=True, capture_output=True, text=True).stdout
    found = dict(re.findall(r"round 2 (write|read) (\d+) MiB/s", out))
    return float(found["write"]), float(found["read"])


def loom(args):
    out = subprocess.run(
        [os.path.join(ROOT, args.build, "bin/loom_nvme_bench"), args.folder,
         "--gib", str(args.gib), "--block-size", str(args.block_size),
         "--queue-depth", str(args.queue_depth), "--rounds", "2"],
        check=True, capture_output=True, text=True).stdout
    # Round 2: the file's blocks written once already, as a swap file is from the second step
    # on (a fresh reserved file's first write also converts its unwritten extents).
    found = dict(re.findall(r"round 2 (write|read) (\d+) MiB/s", out))
    return float(found["write"]), float(found["read"]), out.splitlines()[0]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("folder")
    p.add_argument("--gib", type=int, default=2)
    p.add_argument("--block-size", type=int, default=1 << 20)
    p.add_argument("--queue-depth", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--build", default="build")
    p.add_argument("--reference", choices=("fio", "raw"), default="fio")
    args = p.parse_args()
    reference = fio_both if args.reference == "fio" else raw
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if "model name" in l),
               platform.machine())
    print(f"machine: {cpu}, {os.cpu_count()} cores; folder {args.folder}")
    results = {"fio write": [], "fio read": [], "loom write": [], "loom read": []}
    header = ""
    for _ in range(args.rounds):
        write, read = reference(args)
        results["fio write"].append(write)
        results["fio read"].append(read)
        w, r, header = loom(args)
        results["loom write"].append(w)
        results["loom read"].append(r)
    if args.reference == "fio":
        os.remove(os.path.join(args.folder, "fio-bench.bin"))
    print(header)
    print(f"reference: {args.reference}")
    print(f"| direction | {args.reference} MiB/s (median) | loom MiB/s (median) | loom / {args.reference} |")
    print("|---|---|---|---|")
    for d in ("write", "read"):
        f, l = statistics.median(results["fio " + d]), statistics.median(results["loom " + d])
        print(f"| {d} | {f:.0f} | {l:.0f} | {l / f:.2f} |")
    for k, v in results.items():
        print(k, " ".join(f"{x:.0f}" for x in v))


if __name__ == "__main__":
    main()
