"""loom's data-parallel benchmark: for 2 ranks, how much of the gradient all-reduce is hidden
behind backward with [ddp] overlap_comm on and off (per step: the time spent waiting for
buckets after backward ended vs the buckets' total communication time), and step time of 1 vs
2 ranks. Runs are interleaved over several rounds; medians are reported and written into
docs/BENCHMARKS.md.
usage: .venv/bin/python examples/bench/ddp/run.py [--rounds 3] [--steps 25] [--write]"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchlib import run_loom, write_section  # noqa: E402

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ddp_bench.toml")


def run(ranks, backend, overlap, steps):
    sets = [f"train.max_steps={steps}", f"ddp.overlap_comm={'true' if overlap else 'false'}"]
    return run_loom(JOB, sets, ranks, backend)[5:]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--write", action="store_true")
    a = p.parse_args()
    configs = [("1 rank", 1, "local", True), ("2 ranks gloo, overlap on", 2, "gloo", True),
               ("2 ranks gloo, overlap off", 2, "gloo", False),
               ("2 ranks mpi, overlap on", 2, "mpi", True),
               ("2 ranks mpi, overlap off", 2, "mpi", False)]
    results = {c[0]: {"step": [], "comm": [], "exposed": [], "sps": []} for c in configs}
    for r in range(a.rounds):
        for name, ranks, backend, overlap in configs[r % len(configs):] + configs[:r % len(configs)]:
            rows = run(ranks, backend, overlap, a.steps)
            res = results[name]
            res["step"].append(statistics.median(x["step_time_s"] for x in rows))
            res["sps"].append(statistics.median(x["samples_per_s"] for x in rows))
            if ranks > 1:
                res["comm"].append(statistics.median(x["ddp_comm_s"] for x in rows))
                res["exposed"].append(statistics.median(x["ddp_exposed_comm_s"] for x in rows))
            print(f"round {r + 1} {name}: {res['step'][-1] * 1000:.1f} ms/step", file=sys.stderr)
    lines = ["| configuration | step (ms) | samples/s | all-reduce waited for after backward (ms) |",
             "|---|---|---|---|"]
    exposed = {}
    for name, ranks, backend, overlap in configs:
        res = results[name]
        step, sps = statistics.median(res["step"]), statistics.median(res["sps"])
        if res["exposed"]:
            exposed[(backend, overlap)] = statistics.median(res["exposed"])
            lines.append(f"| {name} | {step * 1000:.1f} | {sps:.1f} | {exposed[(backend, overlap)] * 1000:.1f} |")
        else:
            lines.append(f"| {name} | {step * 1000:.1f} | {sps:.1f} | – |")
    # With overlap off every bucket starts after backward, so what the step waits for is the
    # whole all-reduce; with overlap on, only the part backward did not hide.
    hidden = []
    for backend in ("gloo", "mpi"):
        on, off = exposed[(backend, True)], exposed[(backend, False)]
        hidden.append(f"{backend}: {off * 1000:.1f} ms of all-reduce after backward without overlap, "
                      f"{on * 1000:.1f} ms with it: {100 * (1 - on / off):.0f} % hidden behind backward")
    text = "\n".join([
        "GPT 4 layers x 256 wide (3.3 M params), per-rank batch 8 x 128 tokens, reduce_bucket_size "
        f"1 MB; {a.rounds} interleaved rounds of {a.steps} steps (first 5 dropped), medians. "
        "2 cores in all: 1 rank uses 2 threads, 2 ranks 1 thread each (so 2 ranks do twice the "
        "work on the same cores). The last column is the time a step waits for gradient buckets "
        "once backward has ended (metrics.jsonl ddp_exposed_comm_s).",
        "", *lines, "", *[f"- {h}" for h in hidden], "",
        "Command: `.venv/bin/python examples/bench/ddp/run.py --write`"])
    print(text)
    if a.write:
        write_section("ddp", text)


if __name__ == "__main__":
    main()
