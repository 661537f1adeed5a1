"""GPT-2 124M training step: loom against a plain PyTorch loop and the Hugging Face Trainer, on
the same shapes (12 x 768, vocabulary 50257, sequence 256, batch 4, dropout 0, AdamW with torch's
fused kernel in both Python runs), fp32 and bf16 autocast, interleaved, each run in its own
process; median step time after the warm-up steps and peak RSS. The Python side is transformers'
GPT2LMHeadModel on the venv's torch. A fourth process times the floor: the step's matmuls (each
Linear's forward GEMM and its two backward GEMMs, the head's three) and causal attention's
forward and backward alone, in the step's dtype, on the same shapes and threads; what any
implementation's step costs at least, so Trainer / floor bounds how far one can lead the
Trainer. Writes the table into docs/BENCHMARKS.md with --write.

--model llama times the llama-shaped ~124 M model of issue 39 instead (hidden 768, 12 layers, 12
heads and 12 key/value heads, SwiGLU width 2048, vocabulary 32000, untied head): loom's `llama`
(bench/llama_step/llama_124m.toml) against a loop over transformers' LlamaForCausalLM with
attn_implementation="sdpa"; the floor's GEMMs are then q, k, v, o, gate, up, down and the head.
Each side prints its parameter count and shapes to stderr, and the run stops if they differ.

usage: .venv/bin/python examples/bench/gpt2_step/run.py [--model gpt2|llama] [--rounds 3]
       [--steps 8] [--warmup 2] [--precisions fp32,bf16] [--impls loom,loop,trainer,floor]
       [--write]"""
import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchlib import LOOM, ROOT, cpu_name, write_section  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

# What differs between the two models: loom's job, the BENCHMARKS.md section, the table's opening,
# and whether loom's parameters carry transformers' names (llama's do; gpt's are its own, wte,
# h.0.attn..., with Linear where GPT-2 has Conv1D, so only llama's are compared name by name).
MODELS = {
    "gpt2": {"job": os.path.join(HERE, "gpt2_124m.toml"), "section": "gpt2_step",
             "transformers_names": False,
             "shape": "GPT-2 124M (12 x 768, vocabulary 50257, tied head)"},
    "llama": {"job": os.path.join(os.path.dirname(HERE), "llama_step", "llama_124m.toml"),
              "section": "llama_step", "transformers_names": True,
              "shape": "Llama ~124M (12 layers x 768, 12 heads and 12 key/value heads, SwiGLU "
                       "2048, vocabulary 32000, untied head: 134.1 M parameters)"},
}

# One process per run of the Python implementations: prints one JSON line.
PYTHON = r'''
import json, resource, statistics, sys, time
import torch
impl, precision, steps, warmup, batch, seq, threads = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:8])
arch = sys.argv[8]
torch.set_num_threads(threads)
torch.manual_seed(0)
if arch == "llama":
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                         num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                         max_position_embeddings=2048, tie_word_embeddings=False,
                         attention_dropout=0.0, hidden_act="silu")
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
else:
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(n_positions=1024, n_embd=768, n_layer=12, n_head=12, vocab_size=50257,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
vocab = config.vocab_size
shapes = {n: list(p.shape) for n, p in model.named_parameters()}
print(json.dumps({"params": sum(p.numel() for p in model.parameters()), "shapes": shapes}),
      file=sys.stderr)
if impl == "describe":
    sys.exit(0)
total = steps + warmup
ids = torch.randint(0, vocab, (total * batch, seq))
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
arch = sys.argv[7]
torch.set_num_threads(threads)
torch.manual_seed(0)
dt = torch.bfloat16 if precision == "bf16" else torch.float32
C, L, H = 768, 12, 12
N = batch * seq
def linear(out_f, in_f):  # forward, then the gradients of the input and of the weight
    x, w, g = (torch.randn(*s, dtype=dt) for s in ((N, in_f), (out_f, in_f), (N, out_f)))
    return lambda: (torch.mm(x, w.t()), torch.mm(g, w), torch.mm(g.t(), x))
if arch == "llama":  # q, k, v, o; gate, up, down; an untied head over 32000 tokens
    V, I = 32000, 2048
    blocks = [linear(C, C)] * 4 + [linear(I, C)] * 2 + [linear(C, I)]
else:  # the fused qkv, the projection, the two MLP Linears; the tied head over 50257
    V = 50257
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
                          "4", "256", str(a.threads), a.model], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def loom_command(a, out, sets):
    sets = [*sets, f"train.num_threads={a.threads}", f"train.output_dir=\"{out}\""]
    return [LOOM, "run", MODELS[a.model]["job"]] + [x for s in sets for x in ("--set", s)]


def run_loom(precision, a):
    out = tempfile.mkdtemp(prefix="loom-step-")
    cmd = loom_command(a, out, [f"train.max_steps={a.steps + a.warmup}",
                                f"precision.mode=\"{precision}\""])
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    with open(os.path.join(out, "run.json")) as f:
        params = json.load(f)["model_state"]["params"]
    subprocess.run(["rm", "-rf", out], check=True)
    return {"step_s": statistics.median(r["step_time_s"] for r in rows[a.warmup:]),
            "rss_peak_bytes": max(r["rss_peak_bytes"] for r in rows), "params": params}


def described_model(stderr):
    """The parameter count and shapes a Python run printed (its stderr may hold warnings too)."""
    return json.loads(next(l for l in stderr.splitlines() if l.startswith('{"params"')))


def run_python(impl, precision, a):
    done = subprocess.run([sys.executable, "-c", PYTHON, impl, precision, str(a.steps),
                           str(a.warmup), "4", "256", str(a.threads), a.model],
                          check=True, capture_output=True, text=True)
    described = described_model(done.stderr)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    got["params"] = described["params"]
    got["shapes"] = described["shapes"]
    return got


def check_same_model(a):
    """Trains loom one step and saves it, then compares its model.safetensors' names and shapes
    (the header only) with transformers' model of the Python runs: a benchmark of two different
    models would be no comparison."""
    done = subprocess.run([sys.executable, "-c", PYTHON, "describe", "fp32", "0", "0", "1", "8",
                           "1", a.model], check=True, capture_output=True, text=True)
    theirs = described_model(done.stderr)
    out = tempfile.mkdtemp(prefix="loom-step-shapes-")
    try:
        subprocess.run(loom_command(a, out, ["train.max_steps=1", "train.save_final=true"]),
                       check=True, stdout=subprocess.DEVNULL)
        with open(os.path.join(out, "checkpoint-1", "model.safetensors"), "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    finally:
        shutil.rmtree(out, ignore_errors=True)
    ours = {n: v["shape"] for n, v in header.items() if n != "__metadata__"}
    count = sum(math.prod(s) for s in ours.values())
    print(f"parameters: loom {count} in {len(ours)} tensors, transformers {theirs['params']} in "
          f"{len(theirs['shapes'])} tensors", file=sys.stderr)
    for name in sorted(set(ours) | set(theirs["shapes"])):
        if ours.get(name) != theirs["shapes"].get(name):
            sys.exit(f"{name}: loom {ours.get(name)}, transformers {theirs['shapes'].get(name)}: "
                     f"the two sides train different models; fix {MODELS[a.model]['job']}")
    if count != theirs["params"]:
        sys.exit(f"loom has {count} parameters, transformers {theirs['params']}")
    print("shapes (both):", json.dumps(ours), file=sys.stderr)
    return count


IMPLS = {"loom": "loom", "loop": "PyTorch loop", "trainer": "HF Trainer",
         "floor": "floor: GEMMs + attention alone"}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=sorted(MODELS), default="gpt2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--impls", default="loom,loop,trainer,floor",
                   help="which of loom, loop, trainer, floor to run (loop always runs: the "
                        "table's speeds are against it)")
    p.add_argument("--write", action="store_true")
    a = p.parse_args()
    chosen = a.impls.split(",")
    for i in chosen:
        if i not in IMPLS:
            p.error(f"--impls: unknown implementation {i!r}; choose from {', '.join(IMPLS)}")
    if "loop" not in chosen:
        chosen.append("loop")
    runners = {"loom": lambda prec: run_loom(prec, a),
               "loop": lambda prec: run_python("loop", prec, a),
               "trainer": lambda prec: run_python("trainer", prec, a),
               "floor": lambda prec: run_floor(prec, a)}
    impls = {IMPLS[i]: runners[i] for i in IMPLS if i in chosen}
    params = None
    if "loom" in impls and MODELS[a.model]["transformers_names"]:
        params = check_same_model(a)
    load_before = os.getloadavg()
    precisions = a.precisions.split(",")
    results = {(i, prec): [] for i in impls for prec in precisions}
    for r in range(a.rounds):
        for prec in precisions:
            names = list(impls)
            order = names[r % len(names):] + names[:r % len(names)]  # rotate who goes first
            for name in order:
                got = impls[name](prec)
                if params is not None and "params" in got and got["params"] != params:
                    sys.exit(f"{name} trained {got['params']} parameters, not {params}")
                results[(name, prec)].append(got)
                print(f"round {r + 1} {prec} {name}: {got['step_s']:.3f} s/step, "
                      f"peak RSS {got['rss_peak_bytes'] / 2**30:.2f} GiB", file=sys.stderr,
                      flush=True)
    load_after = os.getloadavg()
    tokens = 4 * 256
    trainer = "HF Trainer" in impls
    rows, per_run = [], []
    for prec in precisions:
        med = {n: statistics.median(x["step_s"] for x in results[(n, prec)]) for n in impls}
        rss = {n: max(x["rss_peak_bytes"] for x in results[(n, prec)]) for n in impls}
        for n in impls:
            floor = n.startswith("floor")
            vs_trainer = f" {med['HF Trainer'] / med[n]:.2f}x |" if trainer else ""
            rows.append(f"| {prec} | {n} | {med[n]:.3f} | {tokens / med[n]:.0f} |{vs_trainer} "
                        f"{med['PyTorch loop'] / med[n]:.2f}x | "
                        f"{'—' if floor else f'{rss[n] / 2**30:.2f} GiB'} |")
            per_run.append(f"{prec} {n}: " + ", ".join(f"{x['step_s']:.3f}"
                                                       for x in results[(n, prec)]))
    cmd = (f".venv/bin/python examples/bench/gpt2_step/run.py --model {a.model} "
           f"--rounds {a.rounds} --steps {a.steps} --warmup {a.warmup} --threads {a.threads} "
           f"--precisions {a.precisions} --impls {','.join(i for i in IMPLS if i in chosen)}")
    floor_text = (" The floor row is the step's GEMMs and attention alone (no loss, no elementwise "
                  "op, no update): what any implementation's step costs at least."
                  if "floor" in chosen else "")
    text = "\n".join([
        f"{MODELS[a.model]['shape']}, sequence 256, batch 4, dropout 0, AdamW, clip 1.0; "
        f"{cpu_name()}, {a.threads} threads; {a.rounds} interleaved rounds of {a.steps} steps "
        f"after {a.warmup} warm-up steps, each run its own process, the order rotated per round; "
        f"median of the per-run medians; peak RSS is the largest of the runs. Load average "
        f"(1, 5, 15 min) {' '.join(f'{x:.2f}' for x in load_before)} before the rounds, "
        f"{' '.join(f'{x:.2f}' for x in load_after)} after.{floor_text}",
        "",
        "| precision | implementation | step (s) | tokens/s |"
        + (" speed vs Trainer |" if trainer else "") + " speed vs loop | peak RSS |",
        "|---|---|---|---|---|---|" + ("---|" if trainer else ""),
        *rows,
        "",
        "Per-run median step times (s), in round order: " + "; ".join(per_run) + ".",
        "",
        f"`{cmd}`",
    ])
    print(text)
    if a.write:
        write_section(MODELS[a.model]["section"], text)


if __name__ == "__main__":
    main()
