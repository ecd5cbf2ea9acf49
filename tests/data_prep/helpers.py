"""Shared test helpers: tiny tokenizers trained here, and fixture files in every source format."""

from __future__ import annotations

import io
import json
import os
import random

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]


def corpus_lines(n: int = 400) -> list[str]:
    rng = random.Random(0)
    words = ("the apples cost dollars each total what is how many she has he bought sold left "
             "minus plus times divided by answer clock time hour minute hand points degrees").split()
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(4, 14)):
            r = rng.random()
            if r < 0.3:
                parts.append(str(rng.randint(0, 2000)))
            elif r < 0.35:
                parts.append(f"{rng.randint(1, 99)},{rng.randint(0, 999):03d}")
            else:
                parts.append(rng.choice(words))
        out.append(" ".join(parts) + rng.choice([".", "?", " #### 12", " = 7"]))
    return out


def train_tokenizer(out_dir: str, style: str, chat_template: bool = False, vocab_size: int = 600) -> str:
    """A byte-level BPE saved as a transformers fast tokenizer in `out_dir`.

    style "digits": every digit its own token (Qwen-style); "llama3": numbers split into groups of up
    to three digits that BPE may merge into one token (Llama-3-style).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    if style == "digits":
        split = pre_tokenizers.Digits(individual_digits=True)
    elif style == "llama3":
        split = pre_tokenizers.Split(Regex(r"\d{1,3}"), behavior="isolated")
    else:
        raise ValueError(style)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus_lines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    if chat_template:
        fast.chat_template = CHATML
    fast.save_pretrained(out_dir)
    return out_dir


def hanging_encode_chunk(chunk):
    """data_prep.workers' _encode_chunk, except that the chunk starting at record
    $DATA_PREP_TEST_HANG_AT never returns (a hung worker, for the watchdog test)."""
    import time

    from data_prep.workers import _encode_chunk

    if chunk[0][0] == int(os.environ["DATA_PREP_TEST_HANG_AT"]):
        time.sleep(3600)
    return _encode_chunk(chunk)



def hanging_init_worker(*args):
    """data_prep.workers' _init_worker, except that it never returns (a worker stuck in its set-up)."""
    import time

    time.sleep(3600)


class TwoArgError(Exception):
    """An exception that pickles but cannot be unpickled (its __init__ takes two arguments)."""

    def __init__(self, what, why):
        super().__init__(f"{what}: {why}")


def unsendable_init_worker(sources, tokenize, environ=None):
    """data_prep.workers' _init_worker, with a set-up that raises a TwoArgError."""
    from data_prep import workers

    class Failing(workers.Worker):
        def __init__(self, *args):
            raise TwoArgError("tokenizer", "exploded")

    workers.Worker = Failing  # in this worker process only
    workers._init_worker(sources, tokenize, environ)

# ---- fixture files -----------------------------------------------------------------------------
GSM8K_ROWS = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
                 "clips in May. How many clips did Natalia sell altogether?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 "
               "clips altogether in April and May.\n#### 72"},
    {"question": "A farm has 1,250 hens and buys 350 more. How many hens now?",
     "answer": "1,250 + 350 = 1,600\n#### 1,600"},
    {"question": "Weng earns $12 an hour. She did 50 minutes of babysitting. How much did she earn?",
     "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nShe earned 0.2 x 50 = $10.\n#### 10"},
    {"question": "The temperature was 5 and fell by 8. What is it now?",
     "answer": "5 - 8 = -3\n#### -3"},
]


def write_jsonl(path: str, rows: list, raw_lines: list[str] = ()) -> str:
    with open(path, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
        for line in raw_lines:
            fh.write(line + "\n")
    return path


def png_bytes(color=(200, 30, 30), size=(24, 16)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def write_parquet(path: str, rows: list[dict]) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_csv(path: str, rows: list[dict]) -> str:
    import csv

    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def makedirs(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    return path


# ---- tokenizers of real size, assembled offline --------------------------------------------------
# Sizes of the real ones: Llama-3 has 128,000 regular + 256 special tokens, Qwen2.5 151,643 + 22.
REAL_SIZES = {"llama3": (128_000, 256), "qwen": (151_643, 22)}


def assemble_tokenizer(out_dir: str, style: str) -> str:
    """A byte-level BPE of real size (Llama-3 or Qwen2.5), assembled from a vocab and merges written
    here instead of trained (training 128k merges takes minutes; this takes about a second).

    Both split numbers as the real ones do: "llama3" isolates groups of up to three digits and has a
    token for every 1-3 digit string ("7", "42", "007"), "qwen" splits every digit. The rest of the
    vocabulary is letter n-grams ("ab", "Ġab", "abc", ...) up to the real size, each reachable by a
    merge, so ordinary text encodes to multi-letter tokens. "qwen" also gets a ChatML chat template.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    regular, n_special = REAL_SIZES[style]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges: list[tuple[str, str]] = []

    def add(left: str, right: str) -> None:
        if len(vocab) < regular and left + right not in vocab:
            vocab[left + right] = len(vocab)
            merges.append((left, right))

    digits = "0123456789"
    if style == "llama3":
        for a in digits:
            for b in digits:
                add(a, b)
        for ab in [a + b for a in digits for b in digits]:
            for c in digits:
                add(ab, c)
        split = pre_tokenizers.Split(Regex(r"\d{1,3}"), behavior="isolated")
    elif style == "qwen":
        split = pre_tokenizers.Digits(individual_digits=True)
    else:
        raise ValueError(style)
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    letters += [c.upper() for c in letters]
    level = [u + v for u in ["Ġ"] + letters for v in letters]  # "Ġa" (a word start), "ab", ...
    for u in ["Ġ"] + letters:
        for v in letters:
            add(u, v)
    while len(vocab) < regular:  # grow by one letter per level until the vocabulary is full
        nxt = []
        for w in level:
            for v in letters:
                add(w, v)
                nxt.append(w + v)
                if len(vocab) >= regular:
                    break
            if len(vocab) >= regular:
                break
        level = nxt
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    if style == "llama3":
        specials = ["<|begin_of_text|>", "<|end_of_text|>"] + [
            f"<|reserved_special_token_{i}|>" for i in range(n_special - 2)]
        bos, eos, pad = specials[0], specials[1], specials[1]
    else:
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [
            f"<|extra_{i}|>" for i in range(n_special - 3)]
        bos, eos, pad = None, "<|im_end|>", "<|endoftext|>"
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad)
    if style == "qwen":
        fast.chat_template = CHATML
    assert len(fast) == regular + n_special, (len(fast), regular + n_special)
    fast.save_pretrained(out_dir)
    # The real repos' tokenizer_config.json lists the added tokens ("added_tokens_decoder", written by
    # transformers 4); transformers 5 does not write it, and a config without it loads through a legacy
    # path that parses the whole tokenizer.json in Python (+0.3 s per load at 128k tokens, paid by every
    # data_prep worker), which the real tokenizers skip. Write it as the real ones have it.
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["added_tokens_decoder"] = {
        str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                 "single_word": t.single_word, "special": t.special}
        for i, t in sorted(tok.get_added_tokens_decoder().items())}
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
    return out_dir
