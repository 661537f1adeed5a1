"""Optimizer step benchmark driver: runs every loom update rule (loom_bench_optim), PyTorch's
AdamW (foreach and fused) and a STREAM triad, interleaved in a shuffled order per round, each
in its own process (memory freed between), and prints a Markdown table of medians.

usage: bench_optim.py BUILD_DIR [--rounds 3] [--millions 100] [--steps 3]
                      [--rules adamw,adam8bit,...] [--torch foreach,fused] [--kernel-isa avx512,avx2]
                      [--in-process [--baseline OLD/loom_optim.so]]

--kernel-isa runs adam8bit, adafactor and adamw_bf16 (adamw with state_dtype = "bf16") once per
value with LOOM_KERNEL_ISA set to it (Note [Kernel ISA cap] in core/include/loom/kernel_isa.h);
adamw's clones and sgd's and lion's loops take what the CPU has whatever it says, so they run
once. The table's ISA column is what each run reports it used. Torch runs whatever ATen picks
(ATEN_CPU_CAPABILITY from the environment, if set, reaches it).

--in-process: for a machine others are loading. Per thread count one loom_bench_optim process
holds every rule (per ISA), torch's fused AdamW (at::_fused_adamw_, what
torch.optim.AdamW(fused=True) runs) and, with --baseline PLUGIN, the rules again from another
loom_optim.so; each round steps each of them once in turn, so the load a round meets is shared.
The table gives each rule's median rate and the median over rounds of its ratio to torch's fused
AdamW in the same round; the triad runs before and after in its own process.
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys

TORCH = r'''
import sys, time, json, torch
variant, threads, steps, millions = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
torch.set_num_threads(threads)
rows = int(millions * 1e6) // 100 // 1024
params = [torch.nn.Parameter(torch.randn(rows * 1024 if i == 99 else (rows, 1024)) * 0.02) for i in range(100)]
for p in params:
    p.grad = torch.randn_like(p) * 1e-3
opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **{variant: True})
times = []
for s in range(steps + 1):
    t = time.perf_counter(); opt.step(); dt = time.perf_counter() - t
    if s: times.append(dt)
times.sort()
print(json.dumps({"rule": "torch-" + variant, "threads": threads, "params": sum(p.numel() for p in params), "seconds": times[len(times) // 2], "state_bytes_per_param": 8.0, "kernel_isa": "ATen " + torch.backends.cpu.get_cpu_capability()}))
'''

# The rules whose kernels follow LOOM_KERNEL_ISA.
CAPPED = {"adam8bit", "adafactor", "adamw_bf16"}

# Bytes each rule must move per parameter per step (read + write of param, grad, state).
BYTES = {"adamw": 28, "torch-foreach": 28, "torch-fused": 28, "adam8bit": 16, "lion": 20,
         "sgd": 20, "adafactor": 12, "adamw_bf16": 20}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--millions", type=float, default=100)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rules", default="adamw,adam8bit,adafactor,sgd,lion")
    ap.add_argument("--torch", default="foreach,fused", help="torch AdamW variants")
    ap.add_argument("--kernel-isa", default="", help="LOOM_KERNEL_ISA values, comma-separated")
    ap.add_argument("--in-process", action="store_true", help="one process per thread count")
    ap.add_argument("--baseline", default="", help="with --in-process: an older loom_optim.so")
    a = ap.parse_args()
    if a.in_process:
        return in_process(a)
    exe = os.path.join(a.build, "bin", "loom_bench_optim")
    rules = [r for r in a.rules.split(",") if r]
    variants = ["torch-" + v for v in a.torch.split(",") if v]
    isas = [i for i in a.kernel_isa.split(",") if i] or [""]
    runs = []
    for threads in (1, 2):
        runs.append(([exe, "triad", str(threads), "5", str(a.millions)], {}, ("triad", "", threads)))
        for isa in isas:
            env = {"LOOM_KERNEL_ISA": isa} if isa else {}
            for rule in rules:
                if rule in CAPPED or isa == isas[0]:
                    runs.append(([exe, rule, str(threads), str(a.steps), str(a.millions)], env,
                                 (rule, isa, threads)))
        for variant in variants:
            runs.append(([sys.executable, "-c", TORCH, variant[len("torch-"):], str(threads),
                          str(a.steps), str(a.millions)], {}, (variant, "", threads)))
    results = {}
    for r in range(a.rounds):
        order = runs[:]
        random.Random(r).shuffle(order)
        for command, env, key in order:
            out = json.loads(subprocess.run(command, check=True, capture_output=True, text=True,
                                            env={**os.environ, **env}).stdout.strip().splitlines()[-1])
            results.setdefault(key, []).append(out)
            print(r, key, out, file=sys.stderr, flush=True)
    print("| rule | ISA | threads | Mparams/s (median) | vs best torch | bound Mparams/s | "
          "% of bound | state B/param |")
    print("|---|---|---|---|---|---|---|---|")
    for threads in (1, 2):
        gbps = statistics.median(o["gbps"] for o in results[("triad", "", threads)])
        torch_best = max((statistics.median(o["params"] / o["seconds"]
                                            for o in results[(v, "", threads)]) for v in variants),
                         default=None)
        rows = [(v, "") for v in variants] + [(rule, isa) for isa in isas for rule in rules
                                              if rule in CAPPED or isa == isas[0]]
        for rule, isa in rows:
            outs = results[(rule, isa, threads)]
            rate = statistics.median(o["params"] / o["seconds"] for o in outs)
            bound = gbps * 1e9 / BYTES[rule]
            used = outs[0].get("kernel_isa", "")
            versus = f"{rate / torch_best:.2f}x" if torch_best else ""
            print(f"| {rule} | {used} | {threads} | {rate / 1e6:.0f} | {versus} | "
                  f"{bound / 1e6:.0f} | {100 * rate / bound:.0f}% | "
                  f"{outs[0]['state_bytes_per_param']:.3f} |")
        stream = statistics.median(o["stream_gbps"] for o in results[("triad", "", threads)])
        print(f"| triad | | {threads} | {stream:.1f} GB/s STREAM count, {gbps:.1f} GB/s moved "
              "| | | | |")


def in_process(a):
    exe = os.path.join(a.build, "bin", "loom_bench_optim")
    rules = [r for r in a.rules.split(",") if r]
    isas = [i for i in a.kernel_isa.split(",") if i] or [""]
    entries = ["torch-fused"]
    for isa in isas:
        for rule in rules:
            if rule in CAPPED or isa == isas[0]:
                entries.append(rule + (":" + isa if isa and rule in CAPPED else ""))
                if a.baseline and rule in CAPPED:
                    entries.append(entries[-1] + "@" + a.baseline)

    def triad(threads):
        out = subprocess.run([exe, "triad", str(threads), "5", str(a.millions)], check=True,
                             capture_output=True, text=True).stdout.strip().splitlines()[-1]
        return json.loads(out)["gbps"]

    print("| rule | ISA | plugin | threads | Mparams/s (median) | vs torch fused (median of rounds) "
          "| per-round ratio | % of bound |")
    print("|---|---|---|---|---|---|---|---|")
    for threads in (1, 2):
        gbps = [triad(threads)]
        run = subprocess.run([exe, "compare", str(threads), str(a.rounds), str(a.millions)] + entries,
                             check=True, capture_output=True, text=True).stdout
        gbps.append(triad(threads))
        rows = [json.loads(line) for line in run.splitlines() if line.startswith("{")]
        torch = next(r for r in rows if r["entry"] == "torch-fused")
        for r in rows:
            name, _, plugin = r["entry"].partition("@")
            rule, _, isa = name.partition(":")
            rate = statistics.median(r["params"] / t for t in r["seconds"])
            ratios = [t / s for s, t in zip(r["seconds"], torch["seconds"])]
            bound = statistics.median(gbps) * 1e9 / BYTES[rule]
            # The path that ran (LOOM_KERNEL_ISA caps: "avx512" on an AVX2 CPU runs avx2).
            isa = r.get("kernel_isa") or isa
            print(f"| {rule} | {isa or ('ATen' if rule.startswith('torch') else 'cpu')} | "
                  f"{'baseline' if plugin else 'build'} | {threads} | {rate / 1e6:.0f} | "
                  f"{statistics.median(ratios):.2f}x | "
                  f"{', '.join(f'{x:.2f}' for x in ratios)} | {100 * rate / bound:.0f}% |")
        print(f"| triad | | | {threads} | {', '.join(f'{g:.1f}' for g in gbps)} GB/s moved "
              "(before, after) | | | |")


if __name__ == "__main__":
    main()
