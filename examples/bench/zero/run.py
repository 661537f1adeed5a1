"""loom's ZeRO benchmark: a ~100 M-parameter GPT (fp32, AdamW, batch 1 x 128 tokens per rank)
at [zero] stage 0 (data parallel), 1, 2 and 3 on 2 and 4 ranks, over gloo (loom-launch) and
mpi (mpirun): step time, each rank's model-state bytes (memory tracker, after the first update)
and rank 0's peak tracked memory; and how much of the gradient reduction backward hides, from
runs with overlap_comm on and off (the time a step waits for buckets after backward).
Every run is a fresh `loom run`; steps after the first are kept and their median reported.
usage: .venv/bin/python examples/bench/zero/run.py [--steps 4] [--write]"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchlib import cpu_name, run_loom, write_section  # noqa: E402

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zero_bench.toml")


def run(ranks, backend, stage, steps, overlap=True, extra=()):
    sets = [f"train.max_steps={steps}", f"zero.stage={stage}",
            f"zero.overlap_comm={'true' if overlap else 'false'}", *extra]
    rows = run_loom(JOB, sets, ranks, backend)
    first, kept = rows[0], rows[1:]
    return {
        "step": statistics.median(r["step_time_s"] for r in kept),
        "exposed": statistics.median(r["zero_exposed_comm_s"] for r in kept),
        "comm": statistics.median(r["zero_comm_s"] for r in kept),
        "state": first.get("zero_model_state_measured_bytes"),
        "formula": first.get("zero_model_state_formula_bytes"),
        "peak": max(r["mem_peak_bytes"] for r in rows),
        "rss": max(r["rss_peak_bytes"] for r in rows),
    }


def mib(x):
    return "–" if x is None else f"{x / 2**20:.0f}"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--write", action="store_true")
    p.add_argument("--hidden-only", action="store_true",
                   help="only the overlap table (printed; --write needs the whole run)")
    a = p.parse_args()
    table = ["| ranks | backend | stage | step (s) | model state per rank (MiB, measured) | "
             "ZeRO formula (MiB) | rank 0 peak tracked (MiB) | rank 0 peak RSS (MiB) |",
             "|---|---|---|---|---|---|---|---|"]
    for ranks in () if a.hidden_only else (2, 4):
        for backend in ("gloo", "mpi"):
            for stage in (0, 1, 2, 3):
                r = run(ranks, backend, stage, a.steps)
                print(f"{ranks} {backend} stage {stage}: {r}", file=sys.stderr)
                table.append(f"| {ranks} | {backend} | {stage} | {r['step']:.2f} | {mib(r['state'])} | "
                             f"{mib(r['formula'])} | {mib(r['peak'])} | {mib(r['rss'])} |")
    hidden = ["| backend | stage | waited after backward, overlap off (ms) | overlap on (ms) | "
              "hidden |", "|---|---|---|---|---|"]
    for backend in ("gloo", "mpi"):
        for stage in (0, 2):
            off = run(2, backend, stage, a.steps, overlap=False)
            on = run(2, backend, stage, a.steps, overlap=True)
            frac = 1 - on["exposed"] / off["exposed"] if off["exposed"] > 0 else float("nan")
            print(f"hidden {backend} stage {stage}: off {off} on {on}", file=sys.stderr)
            hidden.append(f"| {backend} | {stage} | {off['exposed'] * 1000:.0f} | "
                          f"{on['exposed'] * 1000:.0f} | {100 * frac:.0f} % |")
    text = "\n".join([
        f"GPT 12 layers x 768 wide, vocabulary 32 000 (110 M parameters), fp32, AdamW, batch 1 x "
        f"128 tokens per rank, reduce_bucket_size 25 MB; {a.steps} steps per run, the first "
        f"dropped, medians; on {cpu_name()}, 2 cores shared by all ranks (so 4 ranks do twice "
        "the work of 2 on the same cores: compare stages within a row group, not across). "
        "Model state: the memory tracker's bytes after the first update minus those before the "
        "model was built (Note [Measured model state]); the formula column is ZeRO's for this "
        "stage and world size with 4-byte weights (fp32 weights need no separate master copy).",
        "", *table, "",
        "Communication hidden behind backward: 2 ranks, the time a step waits for gradient "
        "buckets after backward (metrics.jsonl zero_exposed_comm_s) with overlap_comm off (all "
        "of it) and on.", "", *hidden, "",
        "Command: `.venv/bin/python examples/bench/zero/run.py --write`"])
    print(text)
    if a.write and not a.hidden_only:
        write_section("zero", text)


if __name__ == "__main__":
    main()
