"""Python baseline for loom's overhead benchmark: the same GPT-2-style model and batch in a
plain PyTorch loop (torch.optim.AdamW, default implementation), on the torch of loom's venv.
Not a loom component. Prints one step time per line.
usage: python_loop.py STEPS BATCH SEQ N_LAYER N_EMBD N_HEAD VOCAB THREADS"""
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, c, heads):
        super().__init__()
        self.n_head = heads
        self.ln1, self.ln2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.fc1, self.fc2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x):  # x (B,T,C)
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, layers, c, heads, vocab, positions):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, c), nn.Embedding(positions, c)
        self.blocks = nn.ModuleList(Block(c, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(c)

    def forward(self, ids):  # ids (B,T) -> logits (B,T,V)
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)


def main():
    steps, batch, seq, layers, embd, heads, vocab, threads = map(int, sys.argv[1:9])
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = Gpt(layers, embd, heads, vocab, seq)
    print(f"python_loop: {sum(p.numel() for p in model.parameters())} params, "
          f"{torch.get_num_threads()} threads", file=sys.stderr)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    for _ in range(steps):
        start = time.perf_counter()
        tokens = torch.randint(0, vocab, (batch, seq + 1))
        ids, labels = tokens[:, :-1], tokens[:, 1:]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(ids).view(-1, vocab), labels.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        print(f"{time.perf_counter() - start:.6f} {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
