"""Tokenize text files into the flat token file loom's `[data] source = "tokens"` reads.

The ids are written back to back, one document after another with the tokenizer's end-of-text
id between them (when it has one), as little-endian uint16 when the vocabulary fits, else
uint32. The tokenizer is a Hugging Face tokenizer folder (tokenizer.json, e.g. one that
save_pretrained wrote next to a model you import with `[model] from_pretrained`), or a
byte-level BPE trained here on the files themselves (`--train-bpe VOCAB_SIZE`; it is saved to
OUT.tokenizer.json so text can be encoded and decoded the same way later).

usage:
  .venv/bin/python examples/prepare_data.py --tokenizer gpt2-folder --out data.bin a.txt b.txt
  .venv/bin/python examples/prepare_data.py --train-bpe 2048 --out data.bin corpus.txt

It prints the [data] and [model] lines of a job that trains on the output.
"""
import argparse
import os
import sys

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

END_OF_TEXT = "<|endoftext|>"


def read_documents(paths):
    """Each file is a document; a fortune file's '%' lines split it into documents too."""
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        parts = text.split("\n%\n") if "\n%\n" in text else [text]
        for part in parts:
            if part.strip():
                yield part


def train_bpe(paths, vocab_size):
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(read_documents(paths), trainer=trainer)
    return tokenizer


def load_tokenizer(folder):
    file = os.path.join(folder, "tokenizer.json") if os.path.isdir(folder) else folder
    if not os.path.isfile(file):
        sys.exit(f"prepare_data: error: '{file}' does not exist; give a tokenizer folder "
                 "(with tokenizer.json) or --train-bpe VOCAB_SIZE")
    return Tokenizer.from_file(file)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--tokenizer", help="a tokenizer folder (tokenizer.json) or file")
    source.add_argument("--train-bpe", type=int, metavar="VOCAB_SIZE",
                        help="train a byte-level BPE of this vocabulary on the files")
    parser.add_argument("--out", required=True, help="the token file to write")
    parser.add_argument("--seq-len", type=int, default=128, help="for the printed job lines")
    parser.add_argument("files", nargs="+", help="UTF-8 text files")
    args = parser.parse_args()
    for path in args.files:
        if not os.path.isfile(path):
            sys.exit(f"prepare_data: error: text file '{path}' does not exist")
    # --out data/x.bin into a data/ that is not there yet: made, as a user expects.
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    if args.train_bpe:
        if args.train_bpe < 257:
            sys.exit("prepare_data: error: --train-bpe needs a vocabulary of at least 257 "
                     "(256 bytes and the end-of-text token)")
        tokenizer = train_bpe(args.files, args.train_bpe)
        tokenizer.save(args.out + ".tokenizer.json")
    else:
        tokenizer = load_tokenizer(args.tokenizer)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    eot = tokenizer.token_to_id(END_OF_TEXT)

    ids = []
    for document in read_documents(args.files):
        ids.extend(tokenizer.encode(document).ids)
        if eot is not None:
            ids.append(eot)
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    array = np.asarray(ids, dtype=np.int64)
    if array.size and (array.min() < 0 or array.max() >= vocab):
        sys.exit(f"prepare_data: error: the tokenizer produced id {array.max()} outside its "
                 f"vocabulary of {vocab}")
    # Written under a temporary name and renamed: the file appears whole or not at all.
    temp = args.out + ".tmp"
    array.astype(dtype).tofile(temp)
    os.replace(temp, args.out)

    print(f"wrote {args.out}: {array.size} tokens ({np.dtype(dtype).name}), vocabulary {vocab}")
    print("\n[data]\nsource = \"tokens\"")
    print(f"path = \"{os.path.abspath(args.out)}\"\ndtype = \"{np.dtype(dtype).name}\"")
    print(f"seq_len = {args.seq_len}\n\n[model]\nvocab_size = {vocab}")


if __name__ == "__main__":
    main()
