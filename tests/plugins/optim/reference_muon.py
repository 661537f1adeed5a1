"""Reference Muon for the muon tests, written here from the algorithm of Moonlight's paper (Liu et
al. 2025, "Muon is Scalable for LLM Training", Algorithm 1 and section 2.2) and of its public
toy_train.py: momentum, Nesterov look-ahead, the quintic Newton-Schulz iteration, the update
scaled by 0.2 sqrt(max(A, B)) and decoupled weight decay; AdamW (torch.optim.AdamW itself) for
vectors, embeddings and the head. fp32 throughout (the reference runs the iteration in bf16 on
GPUs; loom runs it in fp32: Note [Newton-Schulz in fp32] in plugins/optim/muon.cpp).

usage: reference_muon.py JOBS_JSON INPUT OUTPUT_PREFIX
JOBS_JSON is a list of configs; job k writes OUTPUT_PREFIX.k.safetensors. input: param.<i>,
grad.<step>.<i>, and the parameters' names in the file's metadata ("names", comma-separated).
A config: lr, weight_decay, momentum, nesterov, ns_steps, coefficients [a, b, c], rms_scale,
betas [b1, b2], eps, decay [0|1 per tensor], and optionally adamw_names (the tensors given to
AdamW besides vectors; default: the names Moonlight's script keeps from Muon, embeddings and
heads). output: param.<step>.<i>.
"""
import json
import math
import sys

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def newton_schulz(g, steps, coefficients):
    """The quintic iteration on one matrix: X = G/(|G|_F + 1e-7), wide; X = aX + (bS + cS^2)X."""
    a, b, c = coefficients
    x = g.clone()
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        s = x @ x.T
        t = b * s + c * s @ s
        x = a * x + t @ x
    return x.T if tall else x


def default_adamw(name):
    # Moonlight's script: p.ndim >= 2 and "embed_tokens" not in name and "lm_head" not in name;
    # GPT-2's embeddings are wte/wpe.
    return any(k in name for k in ("embed_tokens", "lm_head", "wte", "wpe"))


def run(config, names, tensors, target):
    count = len(names)
    steps = sum(1 for k in tensors if k.startswith("grad.")) // count
    params = [tensors[f"param.{i}"].clone() for i in range(count)]
    lr, wd = config["lr"], config["weight_decay"]
    decay = config["decay"]
    adamw_names = config.get("adamw_names")
    use_muon = [p.dim() >= 2 and not (name in adamw_names if adamw_names is not None
                                      else default_adamw(name))
                for name, p in zip(names, params)]
    # AdamW: torch's own, one group per tensor for its weight decay.
    adamw_params = [torch.nn.Parameter(p) for p, m in zip(params, use_muon) if not m]
    adamw_index = [i for i, m in enumerate(use_muon) if not m]
    adamw = None
    if adamw_params:
        groups = [{"params": [p], "weight_decay": wd if decay[i] else 0.0}
                  for p, i in zip(adamw_params, adamw_index)]
        adamw = torch.optim.AdamW(groups, lr=lr, betas=tuple(config["betas"]), eps=config["eps"],
                                  foreach=False)
    buffers = [torch.zeros_like(p) for p in params]
    out = {}
    for step in range(steps):
        for i in range(count):
            g = tensors[f"grad.{step}.{i}"]
            if not use_muon[i]:
                adamw_params[adamw_index.index(i)].grad = g.clone()
                continue
            mu = config["momentum"]
            buffers[i].mul_(mu).add_(g)
            d = g + mu * buffers[i] if config["nesterov"] else buffers[i]
            # Rank > 2: a stack of matrices over the leading dimensions, each on its own.
            rows, cols = d.shape[-2], d.shape[-1]
            stack = d.reshape(-1, rows, cols)
            o = torch.stack([newton_schulz(m, config["ns_steps"], config["coefficients"])
                             for m in stack]).reshape(d.shape)
            scaled = lr * config["rms_scale"] * math.sqrt(max(rows, cols))
            w = wd if decay[i] else 0.0
            params[i].mul_(1 - lr * w)
            params[i].add_(o, alpha=-scaled)
        if adamw is not None:
            with torch.no_grad():
                adamw.step()
            for p, i in zip(adamw_params, adamw_index):
                params[i] = p.data
        for i in range(count):
            out[f"param.{step}.{i}"] = params[i].clone()
    save_file(out, target)


def main():
    jobs, source, prefix = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
    with safe_open(source, framework="pt") as f:
        names = f.metadata()["names"].split(",")
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for k, config in enumerate(jobs):
        run(config, names, tensors, f"{prefix}.{k}.safetensors")


if __name__ == "__main__":
    main()
