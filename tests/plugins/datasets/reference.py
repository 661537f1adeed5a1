"""Independent references for the jsonl/csv data sources (tests/plugins/datasets).

`reference.py make DIR` writes a small byte-level BPE tokenizer (Llama 3's split regex, the
special tokens of Llama 3's and ChatML's chat formats) into DIR/llama3 and DIR/chatml (the same
tokenizer.json; tokenizer_config.json with each format's Jinja chat template), chat.jsonl and
classify.jsonl, and what transformers makes of them:
  expected_chat_<format>.jsonl: the ids of apply_chat_template's text and, per token, whether it
    lies inside an assistant message's content or its end-of-turn token (from the offsets);
  expected_classify.jsonl: tokenizer(text, text_pair, truncation=True, max_length=24).
"""
import json
import os
import random
import sys

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
         r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>", "<|im_start|>", "<|im_end|>"]
TEMPLATES = {
    "llama3": ("{% set loop_messages = messages %}{% for message in loop_messages %}"
               "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
               " + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
               "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"),
    "chatml": ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
               "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"),
}
END_OF_TURN = {"llama3": "<|eot_id|>", "chatml": "<|im_end|>"}
WORDS = ("the a cat dog sat on mat why how what is 42 3.14 hello world réponse 東京 naïve "
         "don't it's we'll I'm 😀 code: x = f(y) + 1; print(x)").split(" ")


def sentence(rng, n):
    s = " ".join(rng.choice(WORDS) for _ in range(n))
    return rng.choice(["", " ", "\n", "  "]) + s + rng.choice(["", ".", "?", "\n", " \n"])


def make_tokenizer(rng):
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([sentence(rng, 30) for _ in range(2000)], trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
        special_tokens=[("<|begin_of_text|>", bos)])
    return tok


def assistant_spans(text, messages, fmt, rendered_prefixes):
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start, stop = rendered_prefixes[k], rendered_prefixes[k + 1]
        content = m["content"].strip() if fmt == "llama3" else m["content"]
        at = text.index(content + END_OF_TURN[fmt], start, stop)
        spans.append((at, at + len(content) + len(END_OF_TURN[fmt])))
    return spans


def make(out):
    rng = random.Random(7)
    tok = make_tokenizer(rng)
    chats = []
    for i in range(60):
        messages = []
        if i % 3 == 0:
            messages.append({"role": "system", "content": sentence(rng, 6)})
        for _ in range(rng.randint(1, 3)):
            messages.append({"role": "user", "content": sentence(rng, rng.randint(1, 12))})
            messages.append({"role": "assistant", "content": sentence(rng, rng.randint(1, 12))})
        chats.append(messages)
    with open(os.path.join(out, "chat.jsonl"), "w") as f:
        for messages in chats:
            f.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
    for fmt, template in TEMPLATES.items():
        folder = os.path.join(out, fmt)
        os.makedirs(folder, exist_ok=True)
        tok.save(os.path.join(folder, "tokenizer.json"))
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
                       "chat_template": template}, f)
        hf = PreTrainedTokenizerFast.from_pretrained(folder)
        with open(os.path.join(out, f"expected_chat_{fmt}.jsonl"), "w") as f:
            for messages in chats:
                text = hf.apply_chat_template(messages, tokenize=False)
                prefixes = [len(hf.apply_chat_template(messages[:k], tokenize=False)) if k else 0
                            for k in range(len(messages) + 1)]
                spans = assistant_spans(text, messages, fmt, prefixes)
                enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
                mask = [int(any(a <= s and e <= b for a, b in spans) and e > s)
                        for s, e in enc["offset_mapping"]]
                f.write(json.dumps({"ids": enc["input_ids"], "target": mask}) + "\n")
    hf = PreTrainedTokenizerFast.from_pretrained(os.path.join(out, "llama3"))
    names = ["negative", "neutral", "positive"]
    with open(os.path.join(out, "classify.jsonl"), "w") as f, \
            open(os.path.join(out, "expected_classify.jsonl"), "w") as g:
        for i in range(40):
            row = {"text": sentence(rng, rng.randint(1, 20)), "label": rng.choice(names)}
            if i % 2:
                row["text_pair"] = sentence(rng, rng.randint(1, 20))
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            enc = hf(row["text"], row.get("text_pair"), truncation=True, max_length=24,
                     return_token_type_ids=True)
            g.write(json.dumps({"ids": enc["input_ids"], "type_ids": enc["token_type_ids"],
                                "label": sorted(names).index(row["label"])}) + "\n")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "make":
        make(sys.argv[2])
    else:
        sys.exit("usage: reference.py make DIR")
