"""An independent reference of one MoE layer (Switch top-1 / GShard top-2), token by token.

usage: moe_ref.py FILE.safetensors TOP_K CAPACITY_FACTOR MIN_CAPACITY DROPLESS AUX_COEF Z_COEF
FILE holds the layer's input x (B,T,C), the weights (router (E,C), w_in (E,H,C), b_in (E,H),
w_out (E,C,H), b_out (E,C)), g (the output's gradient weight) and loom's results: out, aux,
and the gradients grad_<name> of sum(out * g) + aux. Written from the papers' definitions:
gates are the softmax probabilities of the chosen experts (renormalised over the top-k when
k > 1); first choices are placed before second choices, tokens in order, until an expert holds
ceil(capacity_factor * tokens * k / E) (at least MIN_CAPACITY); the load-balancing loss is
aux_coef * E * sum_i f_i P_i (f_i: fraction of the tokens*k choices naming expert i), the
z-loss z_coef * mean(logsumexp(logits)^2). Exits non-zero when loom differs by more than 1e-5.
"""
import math
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

path, k, factor, min_capacity, dropless, aux_coef, z_coef = sys.argv[1:8]
k, factor, min_capacity = int(k), float(factor), int(min_capacity)
dropless, aux_coef, z_coef = dropless == "1", float(aux_coef), float(z_coef)
t = {name: v.double() for name, v in load_file(path).items()}
names = ["x", "router", "w_in", "b_in", "w_out", "b_out"]
p = {n: t[n].clone().requires_grad_(True) for n in names}

x = p["x"].reshape(-1, p["x"].shape[-1])
n, experts = x.shape[0], p["router"].shape[0]
logits = x @ p["router"].T
probs = logits.softmax(-1)
top = probs.topk(k, dim=-1)
gates = top.values / top.values.sum(-1, keepdim=True) if k > 1 else top.values
capacity = math.inf if dropless else max(min_capacity, math.ceil(factor * n * k / experts))

filled = [0] * experts
rows = [torch.zeros(x.shape[1], dtype=torch.float64) for _ in range(n)]
dropped = 0
for j in range(k):
    for token in range(n):
        e = int(top.indices[token, j])
        if filled[e] >= capacity:
            dropped += 1
            continue
        filled[e] += 1
        h = F.gelu(p["w_in"][e] @ x[token] + p["b_in"][e], approximate="tanh")
        rows[token] = rows[token] + gates[token, j] * (p["w_out"][e] @ h + p["b_out"][e])
out = torch.stack(rows).reshape(p["x"].shape)

chosen = F.one_hot(top.indices.reshape(-1), experts).double()
fraction = chosen.sum(0) / (n * k)
aux = aux_coef * experts * (fraction * probs.mean(0)).sum()
aux = aux + z_coef * torch.logsumexp(logits, -1).pow(2).mean()
((out * t["g"]).sum() + aux).backward()

worst = 0.0
def compare(what, ours, theirs):
    global worst
    diff = float((ours - theirs).abs().max()) if ours.numel() else 0.0
    worst = max(worst, diff)
    print(f"{what}: max |difference| {diff:.2e}")
compare("out", t["out"], out.detach())
compare("aux", t["aux"], aux.detach())
for name in names:
    compare("grad " + name, t["grad_" + name], p[name].grad)
print(f"dropped {dropped} of {n * k} assignments")
sys.exit(0 if worst <= 1e-5 else 1)
