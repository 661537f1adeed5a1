"""transformers' side of the bert plugin's interop tests (test_bert_hf.cpp). usage:
  bert_hf.py make DIR [mlm]   a random BertForSequenceClassification (or BertForMaskedLM) saved
                              with save_pretrained, and DIR/ref.safetensors: input_ids,
                              attention_mask (the second sample padded) and the classifier's logits
  bert_hf.py logits DIR IN OUT  logits of DIR (BertForSequenceClassification.from_pretrained)
                              for IN's input_ids and attention_mask
  bert_hf.py metrics DIR IN OUT  DIR's mean cross-entropy, accuracy and macro F1 (scikit-learn's
                              definition, computed here class by class) on IN's input_ids and labels
"""
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification

torch.manual_seed(0)
mode, folder = sys.argv[1], sys.argv[2]
if mode == "make":
    config = BertConfig(vocab_size=120, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=96, max_position_embeddings=40, type_vocab_size=2,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)
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
    ids, labels = inputs["input_ids"], inputs["labels"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits.double()
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
    save_file({"loss": loss.reshape(1), "accuracy": torch.tensor([accuracy], dtype=torch.float64),
               "f1": torch.tensor([sum(f1s) / len(f1s)], dtype=torch.float64),
               "margin": (logits.topk(2, -1).values[:, 0] - logits.topk(2, -1).values[:, 1]).min().reshape(1)},
              sys.argv[4])
