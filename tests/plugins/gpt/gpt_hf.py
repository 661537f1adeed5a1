"""transformers' side of the gpt plugin's interop tests (test_gpt_hf.cpp): the independent
reference. usage:
  gpt_hf.py make DIR [untied] [sharded]  a random GPT2LMHeadModel saved with save_pretrained,
                                         and DIR/ref.safetensors: input_ids and its logits
  gpt_hf.py logits DIR IDS OUT           logits of DIR (from_pretrained) for IDS' input_ids
  gpt_hf.py train DIR BATCHES OUT        5 steps of torch AdamW on BATCHES (input_ids, labels
                                         per step) from DIR: the losses
  gpt_hf.py generate DIR IDS N OUT       greedy generate() of N new tokens after IDS' input_ids
  gpt_hf.py eval DIR TOKENS SEQ OUT [DIR2...]  the mean next-token loss (loss.0, loss.1...) of
                                         each folder over every target of the windows of SEQ + 1
                                         ids (stride SEQ) of the uint16 file TOKENS
"""
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel

torch.manual_seed(0)
mode, folder = sys.argv[1], sys.argv[2]
if mode == "make":
    flags = sys.argv[3:]
    config = GPT2Config(vocab_size=96, n_positions=32, n_embd=48, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        initializer_range=0.1 if "peaked" in flags else 0.02,
                        tie_word_embeddings="untied" not in flags)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # biases and norms away from their 0/1 start, so a swap shows
        for name, p in model.named_parameters():
            if "ln" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder, max_shard_size="40KB" if "sharded" in flags else "5GB")
    ids = (torch.arange(32) * 7 % 96).view(2, 16)
    with torch.no_grad():
        logits = model(ids).logits
    save_file({"input_ids": ids, "logits": logits.contiguous()}, f"{folder}/ref.safetensors")
elif mode == "logits":
    model = GPT2LMHeadModel.from_pretrained(folder).eval()
    ids = load_file(sys.argv[3])["input_ids"]
    with torch.no_grad():
        save_file({"logits": model(ids).logits.contiguous()}, sys.argv[4])
elif mode == "train":
    model = GPT2LMHeadModel.from_pretrained(folder).train()
    batches = load_file(sys.argv[3])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.0)
    losses = []
    for step in range(5):
        ids, labels = batches[f"input_ids.{step}"], batches[f"labels.{step}"]
        logits = model(ids).logits
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)).float(),
                                                 labels.view(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    save_file({"losses": torch.stack(losses).double()}, sys.argv[4])
elif mode == "generate":
    model = GPT2LMHeadModel.from_pretrained(folder).eval()
    ids, n = load_file(sys.argv[3])["input_ids"], int(sys.argv[4])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
        # Greedy steps whose top two logits are this close could flip on rounding alone.
        top2 = model(out).logits[0, ids.size(1) - 1:-1].topk(2, dim=-1).values
        assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-4, "a near tie: the test is not sharp"
    save_file({"ids": out[0].contiguous()}, sys.argv[5])
elif mode == "eval":
    import numpy as np
    ids = torch.from_numpy(np.fromfile(sys.argv[3], dtype=np.uint16).astype(np.int64))
    seq = int(sys.argv[4])
    windows = [ids[s:s + seq + 1] for s in range(0, len(ids) - seq, seq)]
    out = {"windows": torch.tensor([len(windows)])}
    for i, path in enumerate([folder] + sys.argv[6:]):
        model = GPT2LMHeadModel.from_pretrained(path).eval()
        total = torch.zeros((), dtype=torch.float64)
        with torch.no_grad():
            for w in windows:
                logits = model(w[:-1].unsqueeze(0)).logits[0]
                total += torch.nn.functional.cross_entropy(logits.float(), w[1:],
                                                           reduction="sum").double()
        out[f"loss.{i}"] = (total / (seq * len(windows))).reshape(1)
    save_file(out, sys.argv[5])
