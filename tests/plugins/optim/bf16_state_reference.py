"""Reference for adamw with [optimizer] state_dtype = "bf16" (Note [Stochastic rounding of the
state] in core/src/adamw.cpp), written from that Note, not from the C++: the counter-based
random bits (SplitMix64's finaliser, FNV-1a, Chris Wellons' lowbias32) in numpy integers, the
moments widened from bf16 by torch, torch.optim.AdamW's arithmetic as separate fp32 ops (each
rounded, as the kernel's expression is without FMA contraction; the square root correctly
rounded, as the kernel's sqrtps is), and the stochastic rounding
as "add 16 random bits to the low half of the fp32 bits, truncate".

usage: bf16_state_reference.py CONFIG_JSON INPUT OUTPUT
CONFIG_JSON: {"seed", "lr", "beta1", "beta2", "eps", "weight_decay", "steps",
              "segments": [{"name", "offset"}, ...]}.
INPUT holds, for segment k: param.k (fp32), exp_avg.k and exp_avg_sq.k (bf16, the state before
step 1), grad.<step>.k (fp32, steps 1..steps). OUTPUT gets param.k, exp_avg.k, exp_avg_sq.k
after the last step.
"""
import json
import math
import sys

import numpy as np
import torch
from safetensors.torch import load_file, save_file

M64 = (1 << 64) - 1


def mix64(z):
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def fnv1a64(text):
    h = 0xCBF29CE484222325
    for byte in text.encode():
        h = ((h ^ byte) * 0x100000001B3) & M64
    return h


def lowbias32(x):
    x = x.astype(np.uint64)
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & np.uint64(0xFFFFFFFF)
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x846CA68B)) & np.uint64(0xFFFFFFFF)
    x ^= x >> np.uint64(16)
    return x


def random_bits(seed, name, step, offset, n):
    """32 random bits per element of a segment of n elements starting at `offset`."""
    index = np.arange(offset, offset + n, dtype=np.uint64)
    out = np.empty(n, dtype=np.uint64)
    tensor_key = mix64(seed ^ fnv1a64(name))
    for high in np.unique(index >> np.uint64(32)):
        sel = (index >> np.uint64(32)) == high
        key = mix64(mix64(tensor_key ^ step) ^ int(high))
        low = index[sel] & np.uint64(0xFFFFFFFF)
        x = lowbias32(low ^ np.uint64(key & 0xFFFFFFFF))
        out[sel] = lowbias32(x ^ np.uint64(key >> 32))
    return out


def round_stochastic(x, random16):
    """fp32 tensor -> bf16 tensor: the random 16 bits added below bf16's last place, truncated."""
    bits = x.numpy().view(np.uint32).astype(np.uint64)
    rounded = ((bits + random16) >> np.uint64(16)) & np.uint64(0xFFFF)
    nan = (bits & np.uint64(0x7FFFFFFF)) > np.uint64(0x7F800000)
    rounded = np.where(nan, (bits >> np.uint64(16)) | np.uint64(0x40), rounded)
    return torch.from_numpy(rounded.astype(np.uint16).view(np.int16)).view(torch.bfloat16)


def main():
    config = json.loads(sys.argv[1])
    tensors = load_file(sys.argv[2])
    f32 = lambda v: torch.tensor(np.float32(v))  # a coefficient as the kernel holds it
    b1, b2 = config["beta1"], config["beta2"]
    out = {}
    for k, segment in enumerate(config["segments"]):
        p = tensors[f"param.{k}"].clone()
        m = tensors[f"exp_avg.{k}"].clone()
        v = tensors[f"exp_avg_sq.{k}"].clone()
        for step in range(1, config["steps"] + 1):
            g = tensors[f"grad.{step}.{k}"]
            bc1 = 1.0 - b1 ** step
            bc2_sqrt = math.sqrt(1.0 - b2 ** step)
            m0, v0 = m.float(), v.float()
            mi = m0 + f32(1.0 - b1) * (g - m0)
            vi = f32(b2) * v0 + f32(1.0 - b2) * g * g
            # Correctly rounded: torch's CPU sqrt of a long fp32 tensor is not (VML).
            root = torch.sqrt(vi.double()).float()
            denominator = root / f32(bc2_sqrt) + f32(config["eps"])
            p = p * f32(1.0 - config["lr"] * config["weight_decay"]) - \
                f32(config["lr"] / bc1) * (mi / denominator)
            bits = random_bits(config["seed"], segment["name"], step, segment["offset"], p.numel())
            m = round_stochastic(mi, bits & np.uint64(0xFFFF))
            v = round_stochastic(vi, bits >> np.uint64(16))
        out[f"param.{k}"] = p.contiguous()
        out[f"exp_avg.{k}"] = m.contiguous()
        out[f"exp_avg_sq.{k}"] = v.contiguous()
    save_file(out, sys.argv[3])


if __name__ == "__main__":
    main()
