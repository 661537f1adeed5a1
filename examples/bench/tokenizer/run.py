"""Tokenizer speed: loom::Tokenizer (C++, ICU) against the `tokenizers` package (Rust) on the
same ~1 MB of mixed text (prose in a dozen scripts, emoji, digits, whitespace runs, code: the
corpus of tests/core/tokenizer/reference.py) with the same tokenizer.json, one family at a
time: GPT-2's byte-level BPE, Llama 3's and Qwen 2's split-regex BPE, BERT's WordPiece, Llama
2's SentencePiece BPE (byte fallback), a T5-style unigram. Both
encode each document with its special tokens on one thread (tokenizers' encode() in a loop,
RAYON_NUM_THREADS=1); tokenizers' encode_batch on every core is shown beside. Rounds
interleave loom and tokenizers; medians. Writes the table into docs/BENCHMARKS.md with --write.

usage: .venv/bin/python examples/bench/tokenizer/run.py [--rounds 5] [--write]"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchlib import ROOT, cpu_name, write_section  # noqa: E402

TOKENIZERS_TIMER = r"""
import json, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1] + "/tokenizer.json")
docs = [json.loads(l)["text"] for l in open(sys.argv[2], encoding="utf-8") if l.strip()]
batch = sys.argv[3] == "batch"
start = time.perf_counter()
if batch:
    ids = sum(len(e.ids) for e in tok.encode_batch(docs))
else:
    ids = sum(len(tok.encode(d).ids) for d in docs)
print(json.dumps({"seconds": time.perf_counter() - start, "ids": ids}))
"""


def isa():
    flags = open("/proc/cpuinfo").read()
    return "AVX-512 BF16" if "avx512_bf16" in flags else "AVX-512" if "avx512f" in flags else "AVX2"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--write", action="store_true", help="update docs/BENCHMARKS.md")
    a = p.parse_args()
    exe = os.path.join(ROOT, "build/bin/loom_bench_tokenizer")
    work = tempfile.mkdtemp(prefix="loom-tok-bench-")
    subprocess.run([sys.executable, os.path.join(ROOT, "tests/core/tokenizer/reference.py"),
                    "make", work], check=True)
    rows = []
    for family in ("gpt2", "llama3", "qwen2", "bert", "llama2", "t5"):
        folder = os.path.join(work, family)
        docs = os.path.join(folder, "expected.jsonl")
        size = sum(len(json.loads(l)["text"].encode()) for l in open(docs, encoding="utf-8"))
        loom_s, one_s, batch_s = [], [], []
        for _ in range(a.rounds):
            out = json.loads(subprocess.run([exe, folder, docs, "1"], check=True,
                                            capture_output=True, text=True).stdout)
            loom_s.append(out["seconds"])
            for mode, times, threads in (("one", one_s, "1"), ("batch", batch_s, None)):
                env = dict(os.environ)
                if threads:
                    env["RAYON_NUM_THREADS"] = threads
                got = json.loads(subprocess.run(
                    [sys.executable, "-c", TOKENIZERS_TIMER, folder, docs, mode], env=env,
                    check=True, capture_output=True, text=True).stdout)
                if got["ids"] != out["ids"]:
                    sys.exit(f"{family}: loom made {out['ids']} ids, tokenizers {got['ids']}")
                times.append(got["seconds"])
        mb = size / 1e6
        loom_t, one_t, batch_t = (statistics.median(t) for t in (loom_s, one_s, batch_s))
        rows.append(f"| {family} | {mb:.2f} MB, {out['ids']} ids | **{mb / loom_t:.1f} MB/s** | "
                    f"{mb / one_t:.1f} MB/s | **{one_t / loom_t:.2f}x** | "
                    f"{mb / batch_t:.1f} MB/s ({os.cpu_count()} threads) |")
        print(rows[-1], flush=True)
    table = "\n".join([
        f"Machine: {cpu_name()} ({isa()}), {os.cpu_count()} cores. Command: "
        f"`.venv/bin/python examples/bench/tokenizer/run.py --rounds {a.rounds} --write`; "
        f"medians of {a.rounds} interleaved rounds. Each side encodes every document with its "
        "special tokens, and the id counts agree (the test suite checks the ids themselves).",
        "",
        "| tokenizer.json | text | loom, 1 thread | tokenizers encode(), 1 thread | loom's speed-up "
        "| tokenizers encode_batch() |",
        "|---|---|---|---|---|---|",
        *rows])
    print(table)
    if a.write:
        write_section("tokenizer", table)


if __name__ == "__main__":
    main()
