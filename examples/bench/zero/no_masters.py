"""ZeRO without fp32 masters (issue 39, Note [ZeRO without masters] in
sharding/include/loom/sharding/zero_driver.h): GPT-2 124M's shape (12 x 768, vocabulary 50257,
tied head, no dropout) in full_bf16 on 2 ranks over gloo, one intra-op thread each, batch 4 x 256
tokens per rank, AdamW (lr 1e-4, no clipping), at [zero] stage 3 in memory and stage 2 with the
optimizer state offloaded to NVMe (--nvme FOLDER), and (--places 0nvme) stage 0's offloaded driver
on one process with 2 threads (one GPU's ZeRO-Offload, Note [Offloaded without masters] in
offload/include/loom/offload/offloaded_driver.h), three sides each: fp32 masters (master_dtype
= "fp32"), none (master_dtype = "bf16"), and none with bf16 moments (state_dtype = "bf16" too:
8 B/param over the ranks). The runs rotate, round by round; a run's step time is the median of
its steps after the first (the offloaded update's time and the swap file's bytes read per step
likewise); the memory columns are rank 0's: its model state after the first update (the memory
tracker; the plugin's zero_model_state_measured_bytes), the tracked peak and the peak RSS.
usage: .venv/bin/python examples/bench/zero/no_masters.py [--rounds 3] [--steps 4] [--nvme DIR]
       [--places 3,2nvme,0nvme]"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchlib import cpu_name, run_loom  # noqa: E402

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zero_bench.toml")
RANKS, BATCH, SEQ, VOCAB = 2, 4, 256, 50257
SIDES = [
    ("fp32 masters", ['optimizer.master_dtype="fp32"']),
    ("no masters", ['optimizer.master_dtype="bf16"']),
    ("no masters, bf16 moments", ['optimizer.master_dtype="bf16"', 'optimizer.state_dtype="bf16"']),
]


def run(stage, steps, sets, nvme, ranks):
    if nvme:
        sets = [*sets, f'zero.offload_optimizer={{device="nvme", nvme_path="{nvme}"}}']
    threads = 2 if ranks == 1 else 1  # the machine's 2 cores either way
    rows = run_loom(JOB, [f"train.max_steps={steps}", f"zero.stage={stage}",
                          f"train.num_threads={threads}",
                          'precision.mode="full_bf16"', f"train.per_device_train_batch_size={BATCH}",
                          f"model.vocab_size={VOCAB}", f"model.n_positions={SEQ}",
                          f"data.seq_len={SEQ}", f"data.vocab_high={VOCAB}",
                          "train.max_grad_norm=0", *sets], ranks, "gloo")
    kept = rows[1:]
    return {"step": statistics.median(r["step_time_s"] for r in kept),
            "update": statistics.median(r.get("offload_update_s", 0.0) for r in kept),
            "read": statistics.median(r.get("offload_bytes_read", 0.0) for r in kept),
            # Not reported with offloaded state (outside the formula's memory).
            "state": rows[0].get("zero_model_state_measured_bytes", 0.0),
            "peak": max(r["mem_peak_bytes"] for r in rows),
            "rss": max(r["rss_peak_bytes"] for r in rows)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--nvme", default="", help="a folder for the swap files (no NVMe rows without)")
    p.add_argument("--places", default="3,2nvme,0nvme",
                   help="3: stage 3 in memory; 2nvme, 0nvme: stage 2 on 2 ranks, stage 0 on one "
                        "process, the state on NVMe (with --nvme)")
    args = p.parse_args()
    places = []  # (stage, swap folder, ranks)
    for place in args.places.split(","):
        if place == "3":
            places.append((3, "", RANKS))
        elif place in ("2nvme", "0nvme") and args.nvme:
            places.append((int(place[0]), os.path.abspath(args.nvme), RANKS if place[0] == "2" else 1))
    order = [(place, k) for place in range(len(places)) for k in range(len(SIDES))]
    runs = {key: [] for key in order}
    for r in range(args.rounds):
        shift = r % len(order)
        for place, k in order[shift:] + order[:shift]:
            stage, nvme, ranks = places[place]
            result = run(stage, args.steps, SIDES[k][1], nvme, ranks)
            runs[(place, k)].append(result)
            print(f"round {r} stage {stage}{' nvme' if nvme else ''} {SIDES[k][0]}: {result}",
                  file=sys.stderr, flush=True)
    mib = 1 << 20
    med = statistics.median
    print(f"Machine: {cpu_name()}; {args.rounds} rounds of {args.steps} steps, 2 ranks x 1 thread "
          f"(gloo; stage 0: 1 process x 2 threads), GPT-2 124M full_bf16, batch {BATCH} x {SEQ} "
          f"per rank\n")
    print("| stage | side | step (s) | vs fp32 masters | offloaded update (s) | swap file read "
          "per step (MiB) | rank 0 model state (MiB) | tracked peak (MiB) | peak RSS (GiB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for place, (stage, nvme, ranks) in enumerate(places):
        base = med(x["step"] for x in runs[(place, 0)])
        for k, (name, _) in enumerate(SIDES):
            xs = runs[(place, k)]
            step = med(x["step"] for x in xs)
            off = f"{med(x['update'] for x in xs):.3f} | {med(x['read'] for x in xs) / mib:.0f}" \
                if nvme else "— | —"
            state = med(x["state"] for x in xs)
            state = f"{state / mib:.0f}" if state else "—"
            print(f"| {stage}{', NVMe' if nvme else ''}{', 1 process' if ranks == 1 else ''} | {name} | {step:.3f} | "
                  f"{step / base:.3f}x | {off} | {state} | "
                  f"{med(x['peak'] for x in xs) / mib:.0f} | "
                  f"{med(x['rss'] for x in xs) / (1 << 30):.2f} |")
    print("\nPer-run step times (s), in round order:")
    for place, (stage, nvme, ranks) in enumerate(places):
        for k, (name, _) in enumerate(SIDES):
            print(f"- stage {stage}{', NVMe' if nvme else ''}{', 1 process' if ranks == 1 else ''}, {name}: " +
                  ", ".join(f"{x['step']:.3f}" for x in runs[(place, k)]))


if __name__ == "__main__":
    main()
