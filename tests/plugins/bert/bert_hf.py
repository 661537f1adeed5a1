"""transformers' side of the bert plugin's interop tests (test_bert_hf.cpp). usage:
  bert_hf.py make DIR [mlm] [tokenizer]  a random BertForSequenceClassification (or
                              BertForMaskedLM) saved with save_pretrained, and DIR/ref.safetensors:
                              input_ids, attention_mask (the second sample padded) and the
                              classifier's logits; `tokenizer`: with a WordPiece tokenizer
                              (BertTokenizer's pipeline, lowercasing) of the sentiment task's
                              words, and the label map id2label = positive, negative (not the
                              sorted order)
  bert_hf.py data OUT N SEED  N records {"text", "label"} of a learnable sentiment task: neutral
                              words and one positive word ("positive") or negative one
                              ("negative"); mixed case and punctuation, for the normalizer
  bert_hf.py classify DIR JSONL OUT  DIR's (AutoTokenizer + AutoModelForSequenceClassification)
                              mean cross-entropy, accuracy and macro F1 on JSONL's records
                              (truncation to 16 tokens), labels mapped by DIR's label2id
  bert_hf.py logits DIR IN OUT  logits of DIR (BertForSequenceClassification.from_pretrained)
                              for IN's input_ids and attention_mask
  bert_hf.py metrics DIR IN OUT  DIR's mean cross-entropy, accuracy and macro F1 (scikit-learn's
                              definition, computed here class by class) on IN's input_ids and labels
"""
import json
import random
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification

POSITIVE = ["good", "great", "fine", "happy", "love"]
NEGATIVE = ["bad", "awful", "sad", "poor", "hate"]
NEUTRAL = ["the", "a", "movie", "day", "food", "was", "is", "it", "very", "and", "this", "that",
           "service", "book", "plot", "really", "quite", "so", "i", "we"]
LABELS = ["positive", "negative"]


def metrics_of(logits, labels):
    """Mean cross-entropy, accuracy and macro F1 (scikit-learn's definition, class by class)."""
    loss = torch.nn.functional.cross_entropy(logits, labels)
    guess = logits.argmax(-1).tolist()
    truth = labels.tolist()
    f1s = []
    for c in sorted(set(truth) | set(guess)):
        tp = sum(g == c and t == c for g, t in zip(guess, truth))
        fp = sum(g == c and t != c for g, t in zip(guess, truth))
        fn = sum(g != c and t == c for g, t in zip(guess, truth))
        p = tp / (tp + fp) if tp + fp else 0.0
        r = tp / (tp + fn) if tp + fn else 0.0
        f1s.append(2 * p * r / (p + r) if p + r else 0.0)
    accuracy = sum(g == t for g, t in zip(guess, truth)) / len(truth)
    top2 = logits.topk(2, -1).values
    return {"loss": loss.reshape(1), "accuracy": torch.tensor([accuracy], dtype=torch.float64),
            "f1": torch.tensor([sum(f1s) / len(f1s)], dtype=torch.float64),
            "margin": (top2[:, 0] - top2[:, 1]).min().reshape(1)}


def save_tokenizer(folder):
    import os
    from transformers import BertTokenizerFast
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = list(dict.fromkeys(specials + POSITIVE + NEGATIVE + NEUTRAL + [".", ",", "!", "?"] +
                               letters + ["##" + c for c in letters] + ["##ly", "##ed"]))
    os.makedirs(folder, exist_ok=True)
    tok = BertTokenizerFast(vocab={token: i for i, token in enumerate(vocab)}, do_lower_case=True)
    assert len(tok) == len(vocab)
    tok.save_pretrained(folder)
    return len(vocab)


torch.manual_seed(0)
mode, folder = sys.argv[1], sys.argv[2]
if mode == "make":
    vocab, labels = 120, {"num_labels": 3}
    if "tokenizer" in sys.argv[3:]:
        assert save_tokenizer(folder) <= vocab
        labels = {"id2label": dict(enumerate(LABELS)),
                  "label2id": {name: i for i, name in enumerate(LABELS)}}
    config = BertConfig(vocab_size=vocab, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=96, max_position_embeddings=40, type_vocab_size=2,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **labels)
    cls = BertForMaskedLM if "mlm" in sys.argv[3:] else BertForSequenceClassification
    model = cls(config).eval()
    with torch.no_grad():  # biases and norms away from their 0/1 start, so a swap shows
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    ids = (torch.arange(32) * 7 % 120).view(2, 16)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 11:] = 0
    if cls is BertForSequenceClassification:
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
        save_file({"input_ids": ids, "attention_mask": mask, "logits": logits.contiguous()},
                  f"{folder}/ref.safetensors")
elif mode == "logits":
    model = BertForSequenceClassification.from_pretrained(folder).eval()
    inputs = load_file(sys.argv[3])
    with torch.no_grad():
        logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    save_file({"logits": logits.contiguous()}, sys.argv[4])
elif mode == "metrics":
    model = BertForSequenceClassification.from_pretrained(folder).eval()
    inputs = load_file(sys.argv[3])
    with torch.no_grad():
        logits = model(input_ids=inputs["input_ids"]).logits.double()
    save_file(metrics_of(logits, inputs["labels"]), sys.argv[4])
elif mode == "data":
    rng = random.Random(int(sys.argv[4]))
    with open(folder, "w", encoding="utf-8") as f:
        for _ in range(int(sys.argv[3])):
            label = rng.choice(LABELS)
            words = [rng.choice(NEUTRAL) for _ in range(rng.randint(3, 9))]
            words.insert(rng.randint(0, len(words)),
                         rng.choice(POSITIVE if label == "positive" else NEGATIVE))
            text = " ".join(w.upper() if rng.random() < 0.2 else w for w in words)
            f.write(json.dumps({"text": text[0].upper() + text[1:] + rng.choice([".", "!", "", " ?"]),
                                "label": label}) + "\n")
elif mode == "classify":
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    records = [json.loads(line) for line in open(sys.argv[3], encoding="utf-8") if line.strip()]
    batch = tok([r["text"] for r in records], truncation=True, max_length=16, padding=True,
                return_tensors="pt")
    labels = torch.tensor([model.config.label2id[r["label"]] for r in records])
    with torch.no_grad():
        logits = model(**batch).logits.double()
    save_file(metrics_of(logits, labels), sys.argv[4])
