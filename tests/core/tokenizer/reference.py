"""The independent reference for loom's C++ tokenizers: the `tokenizers` package.

`reference.py make DIR` trains one small tokenizer per family loom reads (GPT-2's byte-level
BPE, Llama 3's and Qwen 2's split-regex byte-level BPE, BERT's WordPiece, Llama 2's
SentencePiece BPE with byte fallback, T5's SentencePiece unigram) on a deterministic
mixed corpus, saves each as DIR/<family>/tokenizer.json (+ tokenizer_config.json), and writes
DIR/<family>/expected.jsonl: for each document of a second, held-out ~1 MB corpus its text
(and a text_pair for BERT) with the ids, type ids and decoded text `tokenizers` gives.
"""
import json
import os
import random
import sys

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers import processors, trainers

SOURCE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(SOURCE, "..", "..", ".."))

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
               r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Scripts and symbols the corpus mixes in: letters with and without case, marks, CJK, RTL,
# emoji (with ZWJ sequences, skin tones and flags), odd spaces, digits of other scripts.
ALPHABETS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "àáâãäåæçèéêëìíîïðñòóôõöøùúûüýþÿÀÉÎÕÜßŒœŠšŽžİı",
    "αβγδεζηθικλμνξοπρστυφχψωΑΒΓΔΕΖΗΘΙΚΛΜΝΞΟΠΡΣΤΥΦΧΨΩάέήίόύώ",
    "абвгдеёжзийклмнопрстуфхцчшщъыьэюяАБВГДЕЁЖЗИЙКЛМНОПРСТУФХЦЧШЩЪЫЬЭЮЯ",
    "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可",
    "あいうえおかきくけこさしすせそたちつてとなにぬねのアイウエオカキクケコ",
    "가나다라마바사아자차카타파하한국어",
    "ابتثجحخدذرزسشصضطظعغفقكلمنهوي",
    "אבגדהוזחטיכלמנסעפצקרשת",
    "अआइईउऊएऐओऔकखगघचछजझटठडढणतथदधनपफबभमयरलवशसह्िीुूेैोौं",
    "e\u0301a\u0308o\u0302n\u0303",  # decomposed accents (NFC changes them)
]
EMOJI = ["😀", "😂", "🥲", "👍", "👍🏽", "👩‍💻", "👨‍👩‍👧‍👦", "🇫🇷", "🇯🇵", "❤️", "🔥", "✨", "🚀", "🤖", "∑", "∞", "€", "£", "¥", "©", "™"]
SPACES = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n", "\u00a0", "\u3000", "\u2009", "    ", "\t\t", "\x0b", "\x85", "\u2028", "\x0c"]
PUNCT = [".", ",", "!", "?", ";", ":", "'", "\"", "(", ")", "[", "]", "{", "}", "-", "--", "...", "«", "»", "“", "”", "’s", "'ll", "'RE", "—", "¿", "¡", "、", "。", "#", "@", "$", "%", "&", "*", "/", "\\", "_", "~", "<", ">", "|", "^", "`", "+", "="]


def fortunes():
    folder = "/usr/share/games/fortunes"
    texts = []
    if os.path.isdir(folder):
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            if "." in name or not os.path.isfile(path):
                continue
            with open(path, encoding="utf-8", errors="replace") as f:
                texts.extend(t.strip("\n") for t in f.read().split("\n%\n") if t.strip())
    return texts


def code_snippets():
    snippets = []
    for sub in ("core/src", "plugins", "tests/core", "scripts"):
        for dirpath, _, files in sorted(os.walk(os.path.join(REPO, sub))):
            for name in sorted(files):
                if name.endswith((".cpp", ".h", ".py", ".sh")):
                    with open(os.path.join(dirpath, name), encoding="utf-8", errors="replace") as f:
                        lines = f.read().split("\n")
                    for i in range(0, len(lines), 12):
                        snippets.append("\n".join(lines[i:i + 12]))
    return snippets


def synthetic(rng):
    parts = []
    for _ in range(rng.randint(5, 40)):
        kind = rng.random()
        if kind < 0.45:
            alphabet = rng.choice(ALPHABETS)
            parts.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12))))
        elif kind < 0.6:
            digits = rng.choice(["0123456789", "0123456789", "٠١٢٣٤٥٦٧٨٩", "०१२३४५६७८९", "①②③"])
            number = "".join(rng.choice(digits) for _ in range(rng.randint(1, 14)))
            parts.append(rng.choice([number, number + "." + number[:3], "-" + number, number + "%"]))
        elif kind < 0.72:
            parts.append("".join(rng.choice(EMOJI) for _ in range(rng.randint(1, 4))))
        elif kind < 0.88:
            parts.append(rng.choice(PUNCT))
        else:
            parts.append(rng.choice(SPACES))
        parts.append(rng.choice([" ", " ", " ", "", "\n", "  "]))
    return "".join(parts)


def corpus(rng, size, pool):
    docs, total = [], 0
    while total < size:
        r = rng.random()
        if r < 0.4 and pool["fortunes"]:
            doc = rng.choice(pool["fortunes"])
        elif r < 0.65 and pool["code"]:
            doc = rng.choice(pool["code"])
        else:
            doc = synthetic(rng)
        if rng.random() < 0.1:
            doc = rng.choice(SPACES) + doc + rng.choice(SPACES)
        docs.append(doc)
        total += len(doc.encode("utf-8"))
    return docs


def byte_level(split, ignore_merges, nfc, vocab_size, train_docs, bos):
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if nfc:
        tok.normalizer = normalizers.NFC()
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = [bos, "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(train_docs, trainer)
    if split is None:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, bos_id)])
    return tok, {"bos_token": bos, "eos_token": "<|end_of_text|>"}


def sentencepiece_bpe(vocab_size, train_docs):
    """Llama 2's and Mistral's tokenizer.json: BPE over whole lines with spaces as "▁" (one
    prepended where the text begins), <0xHH> byte pieces for characters outside the alphabet,
    and the decoder chain that undoes it."""
    specials = ["<unk>", "<s>", "</s>", "<|end_of_text|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                 split=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  limit_alphabet=150, show_progress=False)
    tok.train_from_iterator(train_docs, trainer)
    # The byte pieces, in the model's vocabulary as SentencePiece has them.
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", bos)])
    return tok, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


def unigram(vocab_size, train_docs):
    """T5's tokenizer.json, less its precompiled normalizer: NFKC, words split at "▁" (one
    prepended to every stretch), a unigram model, unk for what no piece covers."""
    specials = ["<pad>", "</s>", "<unk>", "<|end_of_text|>"]
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=specials,
                                      unk_token="<unk>", max_piece_length=12, show_progress=False)
    tok.train_from_iterator(train_docs, trainer)
    eos = tok.token_to_id("</s>")
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B:1 </s>:1", special_tokens=[("</s>", eos)])
    return tok, {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}


def bert(vocab_size, train_docs):
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials,
                                        show_progress=False)
    tok.train_from_iterator(train_docs, trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return tok, {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]",
                 "unk_token": "[UNK]", "mask_token": "[MASK]"}


def make(out, size, only=None):
    rng = random.Random(1234)
    pool = {"fortunes": fortunes(), "code": code_snippets()}
    train_docs = corpus(rng, 600_000, pool)
    test_docs = corpus(rng, size, pool)
    # Special tokens inside text: encode must split them out first.
    for i in range(0, len(test_docs), 50):
        test_docs[i] = test_docs[i] + "<|end_of_text|>" + test_docs[(i + 1) % len(test_docs)]
    # Trained on demand: each test process (ctest runs one family per process) trains only its own.
    families = {
        "gpt2": lambda: byte_level(None, False, False, 3000, train_docs, "<|endoftext|>"),
        "llama3": lambda: byte_level(LLAMA3_SPLIT, True, False, 3000, train_docs, "<|begin_of_text|>"),
        "qwen2": lambda: byte_level(QWEN2_SPLIT, False, True, 3000, train_docs, "<|endoftext|>"),
        "bert": lambda: bert(3000, train_docs),
        "llama2": lambda: sentencepiece_bpe(3000, train_docs),
        "t5": lambda: unigram(3000, train_docs),
    }
    unknown = set(only or []) - families.keys()
    if unknown:
        sys.exit(f"unknown families {sorted(unknown)}; known: {sorted(families)}")
    for name, train in families.items():
        if only and name not in only:
            continue
        tok, config = train()
        folder = os.path.join(out, name)
        os.makedirs(folder, exist_ok=True)
        tok.save(os.path.join(folder, "tokenizer.json"))
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump(config, f)
        with open(os.path.join(folder, "expected.jsonl"), "w", encoding="utf-8") as f:
            for i, text in enumerate(test_docs):
                pair = test_docs[i - 1][:200] if name == "bert" and i % 7 == 0 else None
                enc = tok.encode(text, pair) if pair is not None else tok.encode(text)
                row = {"text": text, "ids": enc.ids, "type_ids": enc.type_ids,
                       "ids_plain": tok.encode(text, add_special_tokens=False).ids,
                       "decoded": tok.decode(enc.ids)}
                if pair is not None:
                    row["text_pair"] = pair
                f.write(json.dumps(row, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "make":
        make(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 1_050_000, sys.argv[4:])
    else:
        sys.exit("usage: reference.py make DIR [BYTES [FAMILY...]] (all families when none named)")
