"""Step time of loom against a plain PyTorch loop on the same GPU, same model, same run: the
seed's BERT-large classifier (24 x 1024, 16 heads, 4096), batch 4 of 512 tokens, AdamW, global
norm clipping at 1.0, fp16 (autocast + dynamic loss scaling) and bf16 (autocast).

The PyTorch loop is what a careful user writes: the same architecture as loom's `bert` plugin
(post-norm blocks, fused qkv, scaled_dot_product_attention, GELU), torch.autocast,
torch.amp.GradScaler for fp16, torch.optim.AdamW(fused=True), clip_grad_norm_ (foreach).
Rounds alternate loom and PyTorch; each reports the median step time after warm-up steps.
Not a CPU benchmark (it refuses to run without CUDA).
usage: python3 examples/bench/gpu/bert_vs_torch.py [--rounds 3] [--steps 30] [--json OUT]"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
LARGE = dict(hidden=1024, layers=24, heads=16, inter=4096, vocab=30522, seq=512, batch=4)


def loom_job(mode, steps, out, shape):
    return "\n".join([
        "[train]", 'model = "bert"', f"max_steps = {steps}",
        f"per_device_train_batch_size = {shape['batch']}", "learning_rate = 5e-5",
        "save_final = false", "progress_bar = false", 'log_level = "warn"',
        f'output_dir = "{out}"', 'device = "cuda"',
        "[model]", f"hidden_size = {shape['hidden']}", f"num_hidden_layers = {shape['layers']}",
        f"num_attention_heads = {shape['heads']}", f"intermediate_size = {shape['inter']}",
        "[data]", 'source = "random_tokens"', f"num_samples = {steps * shape['batch']}",
        f"seq_len = {shape['seq']}", 'task = "classification"', "shuffle = false",
        "[optimizer]", 'name = "adamw"', "weight_decay = 0.0",
        "[precision]", f'mode = "{mode}"']) + "\n"


def run_loom(loom, mode, steps, warmup, shape):
    with tempfile.TemporaryDirectory(prefix="loom-gpu-bench-") as tmp:
        job = os.path.join(tmp, "job.toml")
        with open(job, "w") as f:
            f.write(loom_job(mode, steps, os.path.join(tmp, "run"), shape))
        subprocess.run([loom, "run", job], check=True)
        rows = [json.loads(l) for l in open(os.path.join(tmp, "run", "metrics.jsonl"))]
    times = [r["step_time_s"] for r in rows[warmup:]]
    return statistics.median(times), max(r["mem_peak_bytes"] for r in rows)


def run_torch(mode, steps, warmup, shape):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(s, d, h, inter, p):
            super().__init__()
            s.h, s.p = h, p
            s.qkv, s.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            s.norm1, s.norm2 = nn.LayerNorm(d, eps=1e-12), nn.LayerNorm(d, eps=1e-12)
            s.fc_in, s.fc_out = nn.Linear(d, inter), nn.Linear(inter, d)

        def forward(s, x):
            B, T, C = x.shape
            q, k, v = s.qkv(x).view(B, T, 3, s.h, C // s.h).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=s.p if s.training else 0.0)
            x = s.norm1(x + F.dropout(s.proj(y.transpose(1, 2).reshape(B, T, C)), s.p, s.training))
            return s.norm2(x + F.dropout(s.fc_out(F.gelu(s.fc_in(x))), s.p, s.training))

    class Bert(nn.Module):
        def __init__(s, c):
            super().__init__()
            d = c["hidden"]
            s.word, s.pos, s.token_type = nn.Embedding(c["vocab"], d), nn.Embedding(512, d), nn.Embedding(2, d)
            s.norm = nn.LayerNorm(d, eps=1e-12)
            s.blocks = nn.ModuleList(Block(d, c["heads"], c["inter"], 0.1) for _ in range(c["layers"]))
            s.pooler, s.classifier = nn.Linear(d, d), nn.Linear(d, 2)

        def forward(s, ids, labels):
            T = ids.shape[1]
            x = s.word(ids) + s.pos(torch.arange(T, device=ids.device)) + s.token_type(torch.zeros_like(ids))
            x = F.dropout(s.norm(x), 0.1, s.training)
            for block in s.blocks:
                x = block(x)
            logits = s.classifier(F.dropout(torch.tanh(s.pooler(x[:, 0])), 0.1, s.training))
            return F.cross_entropy(logits.float(), labels, reduction="sum") / labels.numel()

    torch.manual_seed(0)
    device = torch.device("cuda")
    model = Bert(shape).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5, weight_decay=0.0, fused=True)
    dtype = torch.float16 if mode == "fp16" else torch.bfloat16
    scaler = torch.amp.GradScaler("cuda", enabled=mode == "fp16")
    ids = torch.randint(0, shape["vocab"], (steps, shape["batch"], shape["seq"]))
    labels = torch.randint(0, 2, (steps, shape["batch"]))
    torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(steps):
        start = time.perf_counter()
        x, y = ids[step].pin_memory().to(device, non_blocking=True), labels[step].to(device)
        with torch.autocast("cuda", dtype=dtype):
            loss = model(x, y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=False)
        loss.item(), norm.item()  # what a loop that logs each step pays (loom logs every step)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated()
    del model, optimizer
    torch.cuda.empty_cache()
    return statistics.median(times[warmup:]), peak


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--layers", type=int, default=LARGE["layers"], help="fewer for a quick check")
    p.add_argument("--loom", default=os.path.join(ROOT, "build/bin/loom"))
    p.add_argument("--json", default=None, help="also write the raw numbers here")
    a = p.parse_args()
    import torch
    if not torch.cuda.is_available():
        sys.exit("bert_vs_torch: no CUDA device; this benchmark measures GPUs")
    shape = dict(LARGE, layers=a.layers)
    results = {}
    for mode in ("fp16", "bf16"):
        loom_t, torch_t, loom_m, torch_m = [], [], [], []
        for _ in range(a.rounds):  # interleaved: both see the same state of the machine
            t, m = run_loom(a.loom, mode, a.steps, a.warmup, shape)
            loom_t.append(t), loom_m.append(m)
            t, m = run_torch(mode, a.steps, a.warmup, shape)
            torch_t.append(t), torch_m.append(m)
        results[mode] = dict(loom_s=loom_t, torch_s=torch_t, loom_peak=max(loom_m),
                             torch_peak=max(torch_m))
        print(f"{mode}: loom {statistics.median(loom_t) * 1e3:.1f} ms, torch "
              f"{statistics.median(torch_t) * 1e3:.1f} ms", file=sys.stderr)
    gpu = torch.cuda.get_device_name(0)
    lines = [f"BERT {shape['layers']} x {shape['hidden']} classifier, batch {shape['batch']} x "
             f"{shape['seq']} tokens, AdamW, clip 1.0, on one {gpu}; median step time of steps "
             f"{a.warmup + 1}..{a.steps} in each of {a.rounds} interleaved rounds, median over rounds.",
             "", "| precision | loom (ms/step) | PyTorch loop (ms/step) | loom speed vs PyTorch | "
             "loom peak GPU memory (GiB) | PyTorch peak (GiB) |", "|---|---|---|---|---|---|"]
    for mode, r in results.items():
        lt, tt = statistics.median(r["loom_s"]), statistics.median(r["torch_s"])
        lines.append(f"| {mode} | {lt * 1e3:.1f} | {tt * 1e3:.1f} | {tt / lt:.3f}x | "
                     f"{r['loom_peak'] / 2**30:.2f} | {r['torch_peak'] / 2**30:.2f} |")
    print("\n".join(lines))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(gpu=gpu, shape=shape, results=results, table=lines), f, indent=1)


if __name__ == "__main__":
    main()
