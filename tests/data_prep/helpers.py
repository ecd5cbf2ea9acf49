"""Shared test helpers: tiny tokenizers trained here, and fixture files in every source format."""

from __future__ import annotations

import io
import json
import os
import random

from recipes.experiments.real_tokenizers import CHATML

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


# ---- tokenizers of real size, assembled offline: recipes.experiments.real_tokenizers (the GPU check
# builds them too) ----
from recipes.experiments.real_tokenizers import REAL_SIZES, assemble_tokenizer  # noqa: E402,F401
