"""Tiny random transformers model folders with tokenizers trained on the example data.

The fine-tuning jobs of examples/datasets start from a model folder (`[model] from_pretrained`).
This writes the three they name, small enough to run each job offline in seconds — a check
that the job, the data and loom work together, not a model worth training:

  my-gpt2   GPT2LMHeadModel, GPT-2's byte-level BPE                    (finetune_lm.toml)
  my-bert   BertForSequenceClassification, 2 labels, BERT's WordPiece  (classify.toml)
  my-llama  LlamaForCausalLM, byte-level BPE, Llama 3's chat format    (chat_sft.toml)

usage:
  .venv/bin/python examples/tiny_models.py examples/datasets            all three
  .venv/bin/python examples/tiny_models.py --only llama examples/datasets

For a real run, point the job at a real folder instead (`--set model.from_pretrained=PATH`);
examples/README.md says where to get one.
"""
import argparse
import csv
import json
import os
import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "datasets")
# Llama 3's special tokens and chat template (the Instruct models' form): loom's chat format
# `llama3` is chosen by the template's <|start_header_id|>.
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}")


def example_texts():
    """Every text of the example data: the tokenizers learn the words the jobs train on."""
    texts = []
    with open(os.path.join(DATA, "corpus.jsonl"), encoding="utf-8") as f:
        texts += [json.loads(line)["text"] for line in f if line.strip()]
    with open(os.path.join(DATA, "chat.jsonl"), encoding="utf-8") as f:
        texts += [m["content"] for line in f if line.strip()
                  for m in json.loads(line)["messages"]]
    with open(os.path.join(DATA, "reviews.csv"), encoding="utf-8", newline="") as f:
        texts += [row["text"] for row in csv.DictReader(f)]
    return texts


def byte_level_bpe(texts, specials):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=512, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def make_gpt2(folder, texts):
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast
    tok = byte_level_bpe(texts, ["<|endoftext|>"])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    fast = GPT2TokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                             eos_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.save_pretrained(folder)
    config = GPT2Config(vocab_size=len(fast), n_positions=128, n_embd=64, n_layer=2, n_head=4,
                        bos_token_id=fast.eos_token_id, eos_token_id=fast.eos_token_id)
    GPT2LMHeadModel(config).save_pretrained(folder)


def make_bert(folder, texts):
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast
    wordpiece = BertWordPieceTokenizer(lowercase=True)
    wordpiece.train_from_iterator(texts, vocab_size=512, show_progress=False,
                                  special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    fast = BertTokenizerFast(vocab=wordpiece.get_vocab(), do_lower_case=True)
    fast.save_pretrained(folder)
    config = BertConfig(vocab_size=len(fast), hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=128, max_position_embeddings=128,
                        num_labels=2)
    BertForSequenceClassification(config).save_pretrained(folder)


def make_llama(folder, texts):
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    tok = byte_level_bpe(texts, LLAMA3_SPECIALS)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                   eos_token="<|eot_id|>", chat_template=LLAMA3_TEMPLATE)
    # loom reads the chat template from tokenizer_config.json, where transformers 4 and the
    # Hub's Llama 3 folders keep it; transformers 5 would write chat_template.jinja instead.
    fast.save_pretrained(folder, save_jinja_files=False)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, bos_token_id=bos,
                         eos_token_id=fast.eos_token_id, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(folder)


MAKERS = {"gpt2": ("my-gpt2", make_gpt2), "bert": ("my-bert", make_bert),
          "llama": ("my-llama", make_llama)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", help="the folder to write my-gpt2, my-bert, my-llama into")
    parser.add_argument("--only", choices=sorted(MAKERS), action="append",
                        help="make this one only (repeatable)")
    args = parser.parse_args()
    torch.manual_seed(0)
    from transformers.utils import logging
    logging.disable_progress_bar()
    texts = example_texts()
    kinds = args.only or sorted(MAKERS)
    folders = {kind: os.path.join(args.out, MAKERS[kind][0]) for kind in kinds}
    for folder in folders.values():
        if os.path.exists(folder):
            sys.exit(f"tiny_models: error: '{folder}' exists; remove it or write elsewhere")
    for kind, folder in folders.items():
        MAKERS[kind][1](folder, texts)
        print(f"wrote {folder}")


if __name__ == "__main__":
    main()
