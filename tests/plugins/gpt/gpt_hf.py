"""transformers' side of the gpt plugin's interop tests (test_gpt_hf.cpp): the independent
reference. usage:
  gpt_hf.py make DIR [untied] [sharded] [peaked] [tokenizer]  a random GPT2LMHeadModel saved
                                         with save_pretrained, and DIR/ref.safetensors: input_ids
                                         and its logits; `tokenizer`: with a byte-level BPE
                                         tokenizer trained on words.txt's text (GPT-2's pipeline,
                                         <|endoftext|>), the vocabulary its size
  gpt_hf.py logits DIR IDS OUT           logits of DIR (from_pretrained) for IDS' input_ids
  gpt_hf.py train DIR BATCHES OUT        5 steps of torch AdamW on BATCHES (input_ids, labels
                                         per step) from DIR: the losses
  gpt_hf.py generate DIR IDS N OUT       greedy generate() of N new tokens after IDS' input_ids
  gpt_hf.py eval DIR TOKENS SEQ OUT [DIR2...]  the mean next-token loss (loss.0, loss.1...) of
                                         each folder over every target of the windows of SEQ + 1
                                         ids (stride SEQ) of the uint16 file TOKENS
  gpt_hf.py evaljsonl DIR JSONL SEQ OUT [DIR2...]  the same over JSONL's "text" records,
                                         encoded by DIR's tokenizer (AutoTokenizer), each + EOS,
                                         in one stream (TRL's packing)
  gpt_hf.py generate_text DIR PROMPT N OUT  greedy generate() of N new tokens (stopping at EOS)
                                         after tokenizer(PROMPT); OUT (JSON): ids and the decoded
                                         text (skip_special_tokens), all by DIR's own tokenizer
"""
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel

torch.manual_seed(0)
mode, folder = sys.argv[1], sys.argv[2]


def train_tokenizer(folder):
    """A GPT-2-style byte-level BPE of 300 ids trained on varied words, saved as GPT-2's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import GPT2TokenizerFast
    import random
    rng = random.Random(0)
    words = ("the cat dog sat on mat why how what is 42 3.14 hello world réponse 東京 naïve "
             "don't it's we'll I'm 😀 code x = f(y) + 1; print(x) model train loss").split(" ")
    text = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(500)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = GPT2TokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                             eos_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.save_pretrained(folder)
    return len(fast), fast.eos_token_id


def packed_windows(folder, jsonl, seq):
    import json
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder)
    stream = []
    with open(jsonl, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                stream += tok(json.loads(line)["text"])["input_ids"] + [tok.eos_token_id]
    ids = torch.tensor(stream)
    return [ids[s:s + seq + 1] for s in range(0, len(ids) - seq, seq)]


def mean_losses(windows, seq, folders):
    out = {"windows": torch.tensor([len(windows)])}
    for i, path in enumerate(folders):
        model = GPT2LMHeadModel.from_pretrained(path).eval()
        total = torch.zeros((), dtype=torch.float64)
        with torch.no_grad():
            for w in windows:
                logits = model(w[:-1].unsqueeze(0)).logits[0]
                total += torch.nn.functional.cross_entropy(logits.float(), w[1:],
                                                           reduction="sum").double()
        out[f"loss.{i}"] = (total / (seq * len(windows))).reshape(1)
    return out


if mode == "make":
    flags = sys.argv[3:]
    vocab, specials = 96, {}
    if "tokenizer" in flags:
        import os
        os.makedirs(folder, exist_ok=True)
        vocab, eos = train_tokenizer(folder)
        specials = {"bos_token_id": eos, "eos_token_id": eos}
    config = GPT2Config(vocab_size=vocab, **specials, n_positions=32, n_embd=48, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        initializer_range=0.1 if "peaked" in flags else 0.02,
                        tie_word_embeddings="untied" not in flags)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # biases and norms away from their 0/1 start, so a swap shows
        for name, p in model.named_parameters():
            if "ln" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder, max_shard_size="40KB" if "sharded" in flags else "5GB")
    ids = (torch.arange(32) * 7 % vocab).view(2, 16)
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
    save_file(mean_losses(windows, seq, [folder] + sys.argv[6:]), sys.argv[5])
elif mode == "evaljsonl":
    seq = int(sys.argv[4])
    save_file(mean_losses(packed_windows(folder, sys.argv[3], seq), seq, [folder] + sys.argv[6:]),
              sys.argv[5])
elif mode == "generate_text":
    import json
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder)
    model = GPT2LMHeadModel.from_pretrained(folder).eval()
    ids = tok(sys.argv[3], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=int(sys.argv[4]), do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
        top2 = model(out).logits[0, ids.size(1) - 1:-1].topk(2, dim=-1).values
        assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-4, "a near tie: the test is not sharp"
    with open(sys.argv[5], "w", encoding="utf-8") as f:
        json.dump({"ids": out[0].tolist(),
                   "text": tok.decode(out[0], skip_special_tokens=True)}, f)
