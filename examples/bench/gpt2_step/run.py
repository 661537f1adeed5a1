"""GPT-2 124M training step: loom against a plain PyTorch loop and the Hugging Face Trainer, on
the same shapes (12 x 768, vocabulary 50257, sequence 256, batch 4, dropout 0, AdamW with torch's
fused kernel in both Python runs), fp32 and bf16 autocast, interleaved, each run in its own
process; median step time after the warm-up steps and peak RSS. The Python side is transformers'
GPT2LMHeadModel on the venv's torch. A fourth process times the floor: the step's matmuls (each
Linear's forward GEMM and its two backward GEMMs, the head's three) and causal attention's
forward and backward alone, in the step's dtype, on the same shapes and threads; what any
implementation's step costs at least, so Trainer / floor bounds how far one can lead the
Trainer. Writes the table into docs/BENCHMARKS.md with --write.

usage: .venv/bin/python examples/bench/gpt2_step/run.py [--rounds 3] [--steps 8] [--warmup 2]
       [--precisions fp32,bf16] [--write]"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchlib import LOOM, ROOT, cpu_name, write_section  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

# One process per run of the Python implementations: prints one JSON line.
PYTHON = r'''
import json, resource, statistics, sys, time
import torch
from transformers import GPT2Config, GPT2LMHeadModel
impl, precision, steps, warmup, batch, seq, threads = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:8])
torch.set_num_threads(threads)
torch.manual_seed(0)
config = GPT2Config(n_positions=1024, n_embd=768, n_layer=12, n_head=12, vocab_size=50257,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
model = GPT2LMHeadModel(config)
total = steps + warmup
ids = torch.randint(0, 50257, (total * batch, seq))
bf16 = precision == "bf16"
times = []
if impl == "loop":
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)
    model.train()
    for s in range(total):
        x = ids[s * batch:(s + 1) * batch]
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
else:
    from transformers import Trainer, TrainerCallback, TrainingArguments
    class Data(torch.utils.data.Dataset):
        def __len__(self): return ids.shape[0]
        def __getitem__(self, i): return {"input_ids": ids[i], "labels": ids[i]}
    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k): self.t = time.perf_counter()
        def on_step_end(self, *a, **k): times.append(time.perf_counter() - self.t)
    import tempfile
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=batch,
                             max_steps=total, learning_rate=1e-4, weight_decay=0.0,
                             max_grad_norm=1.0, bf16=bf16, use_cpu=True, optim="adamw_torch_fused",
                             logging_strategy="no", save_strategy="no", report_to=[],
                             dataloader_num_workers=0, seed=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Data(), callbacks=[Clock()])
    trainer.train()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"step_s": statistics.median(times[warmup:]), "rss_peak_bytes": peak}))
'''


# The floor: the step's GEMMs and attention alone, no elementwise op, no loss, no update.
FLOOR = r'''
import json, resource, statistics, sys, time
import torch
import torch.nn.functional as F
precision, steps, warmup, batch, seq, threads = sys.argv[1], *map(int, sys.argv[2:7])
torch.set_num_threads(threads)
torch.manual_seed(0)
dt = torch.bfloat16 if precision == "bf16" else torch.float32
C, V, L, H = 768, 50257, 12, 12
N = batch * seq
def linear(out_f, in_f):  # forward, then the gradients of the input and of the weight
    x, w, g = (torch.randn(*s, dtype=dt) for s in ((N, in_f), (out_f, in_f), (N, out_f)))
    return lambda: (torch.mm(x, w.t()), torch.mm(g, w), torch.mm(g.t(), x))
blocks = [linear(3 * C, C), linear(C, C), linear(4 * C, C), linear(C, 4 * C)]
head = linear(V, C)
q, k, v = (torch.randn(batch, H, seq, C // H, dtype=dt, requires_grad=True) for _ in range(3))
go = torch.randn(batch, H, seq, C // H, dtype=dt)
def attention():
    F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(go)
times = []
for s in range(steps + warmup):
    t = time.perf_counter()
    for _ in range(L):
        for f in blocks: f()
        attention()
    head()
    times.append(time.perf_counter() - t)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"step_s": statistics.median(times[warmup:]), "rss_peak_bytes": peak}))
'''


def run_floor(precision, a):
    out = subprocess.run([sys.executable, "-c", FLOOR, precision, str(a.steps), str(a.warmup),
                          "4", "256", str(a.threads)], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_loom(precision, a):
    out = tempfile.mkdtemp(prefix="loom-gpt2-")
    sets = [f"train.max_steps={a.steps + a.warmup}", f"train.num_threads={a.threads}",
            f"train.output_dir=\"{out}\"", f"precision.mode=\"{precision}\""]
    cmd = [LOOM, "run", os.path.join(HERE, "gpt2_124m.toml")] + [x for s in sets for x in ("--set", s)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    subprocess.run(["rm", "-rf", out], check=True)
    return {"step_s": statistics.median(r["step_time_s"] for r in rows[a.warmup:]),
            "rss_peak_bytes": max(r["rss_peak_bytes"] for r in rows)}


def run_python(impl, precision, a):
    out = subprocess.run([sys.executable, "-c", PYTHON, impl, precision, str(a.steps),
                          str(a.warmup), "4", "256", str(a.threads)],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--write", action="store_true")
    a = p.parse_args()
    impls = {"loom": lambda prec: run_loom(prec, a),
             "PyTorch loop": lambda prec: run_python("loop", prec, a),
             "HF Trainer": lambda prec: run_python("trainer", prec, a),
             "floor: GEMMs + attention alone": lambda prec: run_floor(prec, a)}
    precisions = a.precisions.split(",")
    results = {(i, prec): [] for i in impls for prec in precisions}
    for r in range(a.rounds):
        for prec in precisions:
            names = list(impls)
            order = names[r % len(names):] + names[:r % len(names)]  # rotate who goes first
            for name in order:
                got = impls[name](prec)
                results[(name, prec)].append(got)
                print(f"round {r + 1} {prec} {name}: {got['step_s']:.3f} s/step, "
                      f"peak RSS {got['rss_peak_bytes'] / 2**30:.2f} GiB", file=sys.stderr, flush=True)
    tokens = 4 * 256
    rows = []
    for prec in precisions:
        med = {n: statistics.median(x["step_s"] for x in results[(n, prec)]) for n in impls}
        rss = {n: max(x["rss_peak_bytes"] for x in results[(n, prec)]) for n in impls}
        for n in impls:
            floor = n.startswith("floor")
            rows.append(f"| {prec} | {n} | {med[n]:.3f} | {tokens / med[n]:.0f} | "
                        f"{med['HF Trainer'] / med[n]:.2f}x | {med['PyTorch loop'] / med[n]:.2f}x | "
                        f"{'—' if floor else f'{rss[n] / 2**30:.2f} GiB'} |")
    cmd = (f".venv/bin/python examples/bench/gpt2_step/run.py --rounds {a.rounds} --steps {a.steps} "
           f"--warmup {a.warmup} --threads {a.threads} --precisions {a.precisions}")
    text = "\n".join([
        f"GPT-2 124M (12 x 768, vocabulary 50257, tied head), sequence 256, batch 4, dropout 0, "
        f"AdamW, clip 1.0; {cpu_name()}, {a.threads} threads; {a.rounds} interleaved rounds of "
        f"{a.steps} steps after {a.warmup} warm-up steps, each run its own process; median of "
        f"the per-run medians; peak RSS is the largest of the runs. The floor row is the step's "
        f"GEMMs and attention alone (no loss, no elementwise op, no update): its speed vs the "
        f"Trainer is the most any implementation could lead the Trainer by.",
        "",
        "| precision | implementation | step (s) | tokens/s | speed vs Trainer | speed vs loop | peak RSS |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"`{cmd}`",
    ])
    print(text)
    if a.write:
        write_section("gpt2_step", text)


if __name__ == "__main__":
    main()
