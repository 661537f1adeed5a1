"""Reference optimizers for the optim tests: runs one optimizer on the parameters and gradients
of an input safetensors file and writes the parameters after every step. References are
PyTorch's own (AdamW, SGD), Transformers' Adafactor, and Lion written here from the paper.

usage: reference.py JOBS_JSON INPUT OUTPUT_PREFIX
JOBS_JSON is a list of {"rule": ..., "config": {...}}; job k writes OUTPUT_PREFIX.k.safetensors
(one Python start for several references keeps the tests fast). input: param.<i> (initial values), grad.<step>.<i>; tensor i gets config["weight_decay"] when
decay[i] is 1 (the no-decay group of biases/norms otherwise). output: param.<step>.<i>.
"""
import json
import sys

import torch
from safetensors.torch import load_file, save_file


class Lion(torch.optim.Optimizer):
    """Chen et al. 2023, Algorithm 2: c = b1 m + (1-b1) g; p -= lr (sign(c) + wd p);
    m = b2 m + (1-b2) g."""

    def __init__(self, params, lr, betas, weight_decay):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["m"] = torch.zeros_like(p)
                m = state["m"]
                c = m * b1 + p.grad * (1 - b1)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(c), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


def run(rule, config, tensors, target):
    count = sum(1 for k in tensors if k.startswith("param."))
    steps = sum(1 for k in tensors if k.startswith("grad.")) // count
    params = [torch.nn.Parameter(tensors[f"param.{i}"].clone()) for i in range(count)]
    wd = config.get("weight_decay", 0.0)
    groups = [{"params": [p], "weight_decay": wd if config["decay"][i] else 0.0}
              for i, p in enumerate(params)]
    lr = config.get("lr")
    if rule == "adamw":
        opt = torch.optim.AdamW(groups, lr=lr, betas=(config["beta1"], config["beta2"]),
                                eps=config["eps"], foreach=False)
    elif rule == "sgd":
        opt = torch.optim.SGD(groups, lr=lr, momentum=config["momentum"],
                              dampening=config["dampening"], nesterov=config["nesterov"],
                              foreach=False)
    elif rule == "lion":
        opt = Lion(groups, lr=lr, betas=(config["beta1"], config["beta2"]), weight_decay=wd)
    elif rule == "adafactor":
        from transformers.optimization import Adafactor
        opt = Adafactor(groups, lr=None if config["relative_step"] else lr,
                        eps=(config["eps1"], config["eps2"]),
                        clip_threshold=config["clip_threshold"],
                        decay_rate=config["decay_rate"], beta1=config.get("beta1"),
                        scale_parameter=config["scale_parameter"],
                        relative_step=config["relative_step"],
                        warmup_init=config["warmup_init"])
    else:
        raise SystemExit(f"unknown rule {rule}")
    out = {}
    for step in range(steps):
        for i, p in enumerate(params):
            p.grad = tensors[f"grad.{step}.{i}"].clone()
        opt.step()
        for i, p in enumerate(params):
            out[f"param.{step}.{i}"] = p.detach().clone()
    save_file(out, target)


def main():
    jobs, source, prefix = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
    tensors = load_file(source)
    for k, job in enumerate(jobs):
        run(job["rule"], job["config"], tensors, f"{prefix}.{k}.safetensors")


if __name__ == "__main__":
    main()
