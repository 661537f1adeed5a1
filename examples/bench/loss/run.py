"""The GPT-2-vocabulary loss: the unfused linear + cross_entropy against loom's fused, chunked
nn::linear_cross_entropy_sum, forward + backward, fp32 and bf16 autocast, side by side in one
process per precision with the three GEMMs alone as the floor (loom_bench_loss rotates them);
medians, and the peak of live tensor memory each needed. Writes the table into docs/BENCHMARKS.md with --write.

usage: .venv/bin/python examples/bench/loss/run.py [--tokens 1024,4096] [--rounds 7] [--write]"""
import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchlib import ROOT, cpu_name, write_section  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="1024", help="rows (batch x sequence), a comma list")
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--write", action="store_true", help="update docs/BENCHMARKS.md")
    a = p.parse_args()
    exe = os.path.join(ROOT, "build/bin/loom_bench_loss")
    rows = []
    for tokens in a.tokens.split(","):
        for precision in ("fp32", "bf16"):
            out = subprocess.run([exe, precision, tokens, str(a.dim), str(a.vocab),
                                  str(a.rounds), str(a.threads)], check=True,
                                 capture_output=True, text=True).stdout
            got = {r["variant"]: r for r in map(json.loads, out.splitlines())}
            u, f, m = got["unfused"], got["fused"], got["matmuls"]
            rows.append(
                f"| {tokens} | {precision} | {u['seconds']:.3f} s | {f['seconds']:.3f} s | "
                f"**{f['seconds'] / u['seconds']:.2f}x** | {m['seconds']:.3f} s | "
                f"{m['seconds'] / u['seconds']:.2f}x | {u['peak_bytes'] / 2**20:.0f} MiB | "
                f"{f['peak_bytes'] / 2**20:.0f} MiB | **{f['peak_bytes'] / u['peak_bytes']:.2f}x** | "
                f"{u['loss']:.4f} / {f['loss']:.4f} |")
    cmd = (f".venv/bin/python examples/bench/loss/run.py --tokens {a.tokens} --rounds {a.rounds}"
           f" --threads {a.threads}")
    text = "\n".join([
        f"Hidden {a.dim} wide, vocabulary {a.vocab}, forward + backward of the head and the loss; "
        f"{cpu_name()}, {a.threads} threads, medians of {a.rounds} rotating rounds in one process "
        f"per precision. \"3 matmuls\": the head's forward and backward GEMMs alone (the floor of "
        f"any exact loss path; in bf16 with autocast's casts of x and the head). Peak: live tensor "
        f"bytes above the inputs (loom's tracking allocator).",
        "",
        "| tokens | precision | unfused | fused | time ratio | 3 matmuls | matmuls / unfused | "
        "unfused peak | fused peak | peak ratio | loss (unfused / fused) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"`{cmd}`",
    ])
    print(text)
    if a.write:
        write_section("loss", text)


if __name__ == "__main__":
    main()
