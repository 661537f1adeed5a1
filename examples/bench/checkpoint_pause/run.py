"""Checkpoint-pause benchmark (Note [Asynchronous checkpoints]): how long a save blocks the step
loop with [train] async_save = true against a synchronous save of the same state. Not a disk
benchmark: the write itself takes what the storage takes, in the background or not.

Each round is one run of gpt124m.toml (GPT-2 124M's shape, AdamW: a 1.4 GiB checkpoint) with
async_save, 6 steps: checkpoints 2 and 4 are saved in the background (the pause: the host copy
plus the commit; the host buffers are made after the first step, and checkpoint-4 copies into
the ones checkpoint-2 used; a wait for a writer not yet done is reported apart), and the final checkpoint-6 synchronously, the same
state's size, by the same process. Prints each round and the medians.
usage: .venv/bin/python examples/bench/checkpoint_pause/run.py [--rounds 3] [--build build]"""
import argparse
import os
import platform
import re
import shutil
import statistics
import subprocess
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
HERE = os.path.dirname(os.path.abspath(__file__))
NUMBER = r"([0-9.e+-]+)"
# checkpoint-{}: filled in with str.format (the pattern has no other braces).
ASYNC = (r"saved checkpoint \S+/checkpoint-{} \(in the background: written in " + NUMBER +
         r" s; training paused " + NUMBER + r" s for it: " + NUMBER + r" s copying, " +
         NUMBER + r" s committing(?:; and " + NUMBER + r" s waiting for the writer)?\)")
SYNC = re.compile(r"saved checkpoint \S+/checkpoint-6 \(training paused " + NUMBER + r" s for it\)")


def cpu_name():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


def one_round(build):
    out = tempfile.mkdtemp(prefix="loom-bench-pause-")
    try:
        cmd = [os.path.join(ROOT, build, "bin/loom"), "run", os.path.join(HERE, "gpt124m.toml"),
               "--set", f"train.output_dir={out}/run", "--set", "train.max_steps=6",
               "--set", "train.save_steps=2", "--set", "train.async_save=true"]
        log = subprocess.run(cmd, check=True, capture_output=True, text=True).stderr
        row = {}
        for step, name in ((2, "first"), (4, "again")):
            found = re.search(ASYNC.format(step), log)
            if not found:
                raise RuntimeError(f"no checkpoint-{step} line in the run's log:\n" + log[-2000:])
            write, pause, copy, commit, wait = (float(x) if x else 0.0 for x in found.groups())
            row[name] = {"pause": pause, "copy": copy, "commit": commit, "write": write,
                         "wait": wait}
        sync = SYNC.search(log)
        if not sync:
            raise RuntimeError("no checkpoint-6 line in the run's log:\n" + log[-2000:])
        row["sync"] = float(sync.group(1))
        return row
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--build", default="build")
    args = p.parse_args()
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f} at the start")
    rows = []
    print("| round | checkpoint | pause, async (s) | of it: copy / commit (s) | background write (s) "
          "| waited for the writer (s) | synchronous save (s) | pause / sync |")
    print("|---|---|---|---|---|---|---|---|")

    def line(label, which, a, sync):
        print(f"| {label} | {which} | {a['pause']:.3f} | {a['copy']:.3f} / {a['commit']:.3f} | "
              f"{a['write']:.2f} | {a['wait']:.2f} | {sync:.2f} | {100 * a['pause'] / sync:.1f} % |",
              flush=True)

    names = {"first": "2 (first save)", "again": "4 (second save)"}
    for r in range(args.rounds):
        row = one_round(args.build)
        rows.append(row)
        for key, which in names.items():
            line(str(r + 1), which, row[key], row["sync"])
    sync = statistics.median(row["sync"] for row in rows)
    for key, which in names.items():
        med = {k: statistics.median(row[key][k] for row in rows) for k in rows[0][key]}
        line("median", which, med, sync)

if __name__ == "__main__":
    main()
