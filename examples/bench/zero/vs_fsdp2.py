"""loom's ZeRO stage 3 against PyTorch FSDP2 on CPU ranks (issue 39): GPT-2 124M (12 x 768,
vocabulary 50257, tied head, no dropout), fp32, AdamW (lr 1e-4, no clipping), batch 4 x 256
tokens per rank, 2 ranks over gloo, one intra-op thread each. FSDP2's side is written here:
`fully_shard` on every block and then on the root (so the embeddings and final norm are sharded
too), torch's AdamW (fused where it takes sharded parameters, else its default), random tokens.
loom's side is `loom run` of examples/bench/zero/zero_bench.toml at stage 3 with the same shape,
twice: as it comes (freed blocks returned to the system) and with
[zero] stage3_return_freed_memory = false. The three rotate, round by round; each run's step time is the median of its steps after the
first, tokens/s is ranks x batch x sequence / that, and each side's memory is rank 0's peak RSS.
usage: .venv/bin/python examples/bench/zero/vs_fsdp2.py [--rounds 3] [--steps 6]
       (the FSDP2 worker: python -m torch.distributed.run ... vs_fsdp2.py --worker STEPS)"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchlib import ROOT, cpu_name, run_loom  # noqa: E402

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zero_bench.toml")
RANKS, BATCH, SEQ, VOCAB = 2, 4, 256, 50257


def fsdp2_worker(steps):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=768, n_layer=12, n_head=12,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    try:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        kind = "fused"
    except (RuntimeError, ValueError):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        kind = "default"
    generator = torch.Generator().manual_seed(1 + rank)
    times = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        start = time.perf_counter()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    dist.barrier()
    if rank == 0:
        print(json.dumps({"times": times, "optimizer": kind,
                          "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
    dist.destroy_process_group()


def run_fsdp2(steps, port):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS),
           "--master-port", str(port), os.path.abspath(__file__), "--worker", str(steps)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, check=True, env=env, capture_output=True, text=True).stdout
    result = json.loads(next(l for l in out.splitlines() if l.startswith("{")))
    return statistics.median(result["times"][1:]), result["rss"], result["optimizer"]


def run_loom_stage3(steps, return_freed_memory=True):
    rows = run_loom(JOB, [f"train.max_steps={steps}", "zero.stage=3", "train.num_threads=1",
                          f"zero.stage3_return_freed_memory={str(return_freed_memory).lower()}",
                          f"train.per_device_train_batch_size={BATCH}", f"model.vocab_size={VOCAB}",
                          f"model.n_positions={SEQ}", f"data.seq_len={SEQ}",
                          f"data.vocab_high={VOCAB}", "train.max_grad_norm=0"], RANKS, "gloo")
    return (statistics.median(r["step_time_s"] for r in rows[1:]),
            max(r["rss_peak_bytes"] for r in rows))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        fsdp2_worker(args.worker)
        return
    # The sides: loom with freed blocks returned to the system (stage 3's default, the least
    # memory), loom with them kept in malloc's heap, and FSDP2 (Note [Freed weights go back]).
    names = ["loom, [zero] stage 3", "loom, stage 3, stage3_return_freed_memory = false",
             "PyTorch FSDP2"]
    runs, kind = [[], [], []], "?"
    port = 29700 + os.getpid() % 200
    for r in range(args.rounds):
        order = [(r + k) % 3 for k in range(3)]  # rotate which side goes first
        for side in order:
            if side < 2:
                runs[side].append(run_loom_stage3(args.steps, return_freed_memory=side == 0))
            else:
                port += 1
                t, rss, kind = run_fsdp2(args.steps, port)
                runs[2].append((t, rss))
            print(f"round {r}: {names[side]} {runs[side][-1]}", file=sys.stderr, flush=True)
    tokens = RANKS * BATCH * SEQ
    step = [statistics.median(x[0] for x in side) for side in runs]
    mem = [max(x[1] for x in side) for side in runs]
    print(f"{cpu_name()}, {os.cpu_count()} cores (load average {os.getloadavg()[0]:.1f} at the "
          f"end); GPT-2 124M fp32, {RANKS} gloo ranks x 1 thread, batch {BATCH} x {SEQ} per rank; "
          f"median of {args.rounds} interleaved rounds x {args.steps - 1} steps; FSDP2 with "
          f"{kind} AdamW\n")
    print("| side | step (s) | tokens/s | vs FSDP2 | rank 0 peak RSS (GiB) | vs FSDP2 |")
    print("|---|---|---|---|---|---|")
    for name, t, m in zip(names, step, mem):
        print(f"| {name} | {t:.2f} | {tokens / t:.0f} | {step[2] / t:.2f}x | {m / 2**30:.2f} | "
              f"{m / mem[2]:.2f}x |")
    print("per-run step times (s): " + "; ".join(
        name + " " + ", ".join(f"{x[0]:.2f}" for x in side) for name, side in zip(names, runs)))

if __name__ == "__main__":
    main()
