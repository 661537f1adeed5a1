"""Optimizer-in-backward benchmark (Note [Optimizer in backward]): one gpt job run three ways,
interleaved over several rounds (who goes first rotates): the normal step (backward, then the
update of every parameter), [train] optimizer_in_backward = true (each parameter updated as its
gradient is final, the gradient freed at once), and forward + backward alone (the test plugin
`skip_updates` skips every update). Reports the median step time (the first step of each run
left out) and the tracked allocator's peak (rank 0's). With --zero-stage 1 or 2 and --ranks N
every variant runs ZeRO over N gloo ranks, its flat groups of --reduce-bucket-size bytes (Note
[Updating chunks in backward]: each chunk is updated as its reduce-scatter lands, so the saving
needs several groups). --job runs another job file instead of gpt.toml (clipping by global norm
must be off: --set train.max_grad_norm=0), --set overrides its keys.
usage: .venv/bin/python examples/bench/optimizer_in_backward/run.py [--rounds 5] [--steps 6]
       [--accumulation 1] [--threads 0] [--ranks 1] [--zero-stage -1]
       [--reduce-bucket-size 2000000] [--job PATH] [--set KEY=VALUE ...] [--one-stream]
       [--build build]
       [--write] (needs the loom_test_skip_updates target built)"""
import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import benchlib  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
# name: (--set values, a table appended to the job)
VARIANTS = {
    "normal step": ([], ""),
    "optimizer_in_backward": (["train.optimizer_in_backward=true"], ""),
    "forward + backward alone": ([], "\n[skip_updates]\n"),
}
ONE_STREAM = "optimizer_in_backward, backward's stream"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--accumulation", type=int, default=1)
    p.add_argument("--threads", type=int, default=0,
                   help="[train] num_threads (0: the job's, every core)")
    p.add_argument("--ranks", type=int, default=1, help="processes (several: loom-launch, gloo)")
    p.add_argument("--zero-stage", type=int, default=-1, help="[zero] stage (-1: no [zero])")
    p.add_argument("--reduce-bucket-size", type=int, default=2000000,
                   help="[zero] reduce_bucket_size, with --zero-stage")
    p.add_argument("--job", default=os.path.join(HERE, "gpt.toml"),
                   help="the job file (default: gpt.toml beside this script)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a job key for every variant (repeatable)")
    p.add_argument("--one-stream", action="store_true",
                   help="also optimizer_in_backward with its GPU updates on backward's own stream "
                   "(LOOM_IN_BACKWARD_STREAM=0; Note [Updates on a side stream])")
    p.add_argument("--build", default="build", help="the build folder (relative to the root)")
    p.add_argument("--write", action="store_true", help="replace docs/BENCHMARKS.md's table")
    args = p.parse_args()
    build = os.path.join(benchlib.ROOT, args.build)
    benchlib.LOOM = os.path.join(build, "bin/loom")
    benchlib.LAUNCH = os.path.join(build, "bin/loom-launch")
    os.environ["LOOM_PLUGIN_PATH"] = os.path.join(build, "tests/plugins")
    default_job = os.path.abspath(args.job) == os.path.join(HERE, "gpt.toml")
    with open(args.job) as f:
        job_text = f.read()
    zero = ""
    if args.zero_stage >= 0:
        zero = (f"\n[zero]\nstage = {args.zero_stage}\n"
                f"reduce_bucket_size = {args.reduce_bucket_size}\n")
    variants = dict(VARIANTS)
    if args.one_stream:
        variants[ONE_STREAM] = VARIANTS["optimizer_in_backward"]
    jobs = {}
    for name, (_, table) in variants.items():
        fd, jobs[name] = tempfile.mkstemp(prefix="loom-bench-oib-", suffix=".toml")
        with os.fdopen(fd, "w") as f:
            f.write(job_text + zero + table)
    results = {name: [] for name in variants}
    for r in range(args.rounds):
        names = list(variants)
        k = r % len(names)
        for name in names[k:] + names[:k]:
            os.environ["LOOM_IN_BACKWARD_STREAM"] = "0" if name == ONE_STREAM else "1"
            rows = benchlib.run_loom(jobs[name], [
                f"train.max_steps={args.steps}",
                f"train.gradient_accumulation_steps={args.accumulation}",
                f"train.num_threads={args.threads}"] + args.set + variants[name][0],
                ranks=args.ranks)
            results[name].append((statistics.median(x["step_time_s"] for x in rows[1:]),
                                  rows[-1]["mem_peak_bytes"]))
            print(f"round {r}: {name}: {results[name][-1]}", file=sys.stderr, flush=True)
    for path in jobs.values():
        os.remove(path)
    mib = 1 << 20
    base = statistics.median(x[0] for x in results["normal step"])
    fwd_bwd = statistics.median(x[0] for x in results["forward + backward alone"])
    base_peak = statistics.median(x[1] for x in results["normal step"])
    lines = [f"{benchlib.cpu_name()}, {os.cpu_count()} cores (load average "
             f"{os.getloadavg()[0]:.1f} at the end); "
             + ("gpt 4 x 256, vocab 8192, batch 4 x 128 tokens" if default_job else
                os.path.relpath(args.job, benchlib.ROOT))
             + "".join(f", --set {x}" for x in args.set)
             + f", accumulation {args.accumulation}, {args.threads or 'all'} thread(s)"
             + (f", {args.ranks} gloo ranks" if args.ranks > 1 else "")
             + (f", [zero] stage {args.zero_stage} in groups of {args.reduce_bucket_size} B"
                if args.zero_stage >= 0 else "")
             + f"; median of {args.rounds} interleaved rounds x "
             f"{args.steps - 1} steps", "",
             "| variant | step time (s) | vs normal | vs forward + backward | peak (MiB) | "
             "peak vs normal (MiB) |", "|---|---|---|---|---|---|"]
    for name, rows in results.items():
        t = statistics.median(x[0] for x in rows)
        peak = statistics.median(x[1] for x in rows)
        lines.append(f"| {name} | {t:.4f} | {t / base:.3f}x | {t / fwd_bwd:.3f}x | "
                     f"{peak / mib:.1f} | {(peak - base_peak) / mib:+.1f} |")
    text = "\n".join(lines)
    print(text)
    if args.write:
        benchlib.write_section("optimizer_in_backward" + (
            f"_zero{args.zero_stage}" if args.zero_stage >= 0 else ""), text)


if __name__ == "__main__":
    main()
