"""The batched number annotation against slow, obvious references, on random texts with tricky numbers.

`find_numbers` (numpy over code points) must give NUMBER_RE's matches and float(text without commas)
bit for bit; `Encoder.encode` (one pass over a chunk's joined targets, char_to_token per record) must give
the spans a per-record, per-number `char_to_token` lookup gives.
"""

import random
import struct

import pytest

from data_prep.numbers import find_numbers, number_spans
from data_prep.sources.base import Example
from data_prep.tokenize import Encoder, Item, TokenizeConfig

ATOMS = [
    "1,234", "12,345,678", "1,2345", "1,234,56", "999,99", "12,34", ",123", "0.5", "3.", ".5", "1.2.3", "1,234.56",
    "1,2345.6", "-7", "--3", "a-3", "x-3", "(-3)", "]-3", ").-3", "_-3", "5-3", "-0", "-0.0", "007", "0,000",
    "123456789012345", "1234567890123456", "123456789012345678901", "1234567890123.45678", "0.000000000000000000001",
    "é-12", "😀-45", "²-3", "Ω7", "日本123", "ß1,000", "\n-9", " - 4", "#### 1,600", "<<4*5=20>>20",
]
CHARS = list("0123456789" * 3) + list(",,..-- \n_)](xZ") + ["é", "²", "😀", "ß", "½", "\t"]


def random_text(rng: random.Random, non_ascii_digits: bool) -> str:
    parts = []
    for _ in range(rng.randint(0, 30)):
        parts.append(rng.choice(ATOMS) if rng.random() < 0.4 else rng.choice(CHARS))
    if non_ascii_digits and rng.random() < 0.5:
        parts.insert(rng.randint(0, len(parts)), rng.choice(["١٢٣", "２3", "4٥"]))
    return "".join(parts)


def exact(spans):
    return [(a, b, struct.pack("<d", v)) for a, b, v in spans]  # tells -0.0 from 0.0


@pytest.mark.parametrize("non_ascii_digits", [False, True])
def test_find_numbers_equals_the_regex(non_ascii_digits):
    rng = random.Random(7 + non_ascii_digits)
    texts = [random_text(rng, non_ascii_digits) for _ in range(3000)]
    for text in texts + ["\n".join(texts[:200]), "", "no numbers", "1", "-1"]:
        starts, ends, values = find_numbers(text)
        got = list(zip(starts.tolist(), ends.tolist(), values.tolist()))
        assert exact(got) == exact(number_spans(text)), repr(text)


def test_find_numbers_cases():
    def spans(text):
        s, e, v = find_numbers(text)
        return [(text[a:b], x) for a, b, x in zip(s.tolist(), e.tolist(), v.tolist())]

    assert spans("1,2345,678 and 1234,567") == [("1,234", 1234), ("5,678", 5678), ("1234", 1234), ("567", 567)]
    assert spans("x-3 (-3) é-3 😀-3 --3") == [("3", 3), ("-3", -3), ("3", 3), ("-3", -3), ("-3", -3)]
    assert spans("1,2345.6 1.2.3 3. 12,34") == [("1,234", 1234), ("5.6", 5.6), ("1.2", 1.2), ("3", 3), ("3", 3),
                                              ("12", 12), ("34", 34)]
    assert spans("1234567890123456.5") == [("1234567890123456.5", 1234567890123456.5)]


# ChatML whose generation prompt stops before the role name: the rest is "assistant\n" + target + ...,
# so targets start at an offset inside the rest.
OFFSET_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>{% endif %}"
)


@pytest.mark.parametrize("lookup", ["byte-lengths", "offsets"])
@pytest.mark.parametrize("name", ["digits-plain", "llama3-plain", "llama3-chat", "llama3-offset-chat"])
def test_encoder_spans_equal_a_per_span_reference(tokenizers_dir, tmp_path, name, lookup):
    """Numbers at token boundaries (Llama-style groups of 3 digits), multibyte characters before numbers,
    targets that end and start with digits (neighbours in a chunk), a chat template that puts targets at
    an offset inside the rest, several chunks; numbers placed on tokens by byte lengths (ASCII rests of
    these byte-level tokenizers) and by offsets (the other rests, and all of them with it turned off)."""
    from transformers import AutoTokenizer

    path = tokenizers_dir[name.replace("offset-", "")]
    if "offset" in name:
        tok = AutoTokenizer.from_pretrained(path)
        tok.chat_template = OFFSET_TEMPLATE
        tok.save_pretrained(tmp_path / "offset")
        path = str(tmp_path / "offset")
    rng = random.Random(3)
    enc = Encoder(TokenizeConfig(path, max_length=100_000))
    assert enc.byte_lengths is not None
    if lookup == "offsets":
        enc.byte_lengths = None
    ascii_only = str.maketrans({c: None for c in "é²😀ß½"})
    items = [Item(i, f"t/{i}", Example(prompt=random_text(rng, False) or "q",
                                       target=(random_text(rng, False) or "0").translate(ascii_only if i % 2 else {})
                                       or "0", answer=1.0)) for i in range(300)]
    if "offset" in name:
        assert all(enc.template.render(it.example.prompt, it.example.target)[2] == len("assistant\n")
                   for it in items)
    rows = []
    for lo in range(0, len(items), 97):
        batch, rejects = enc.encode(items[lo:lo + 97])
        assert rejects == []
        rows += batch.to_pylist()
    nb = len(enc.template.bos)
    for it, row in zip(items, rows):
        prefix, rest, at = enc.template.render(it.example.prompt, it.example.target)
        pair = enc.backend.encode(prefix, rest, add_special_tokens=False)
        want = []
        for a, b, v in number_spans(it.example.target):
            t0, t1 = pair.char_to_token(at + a, 1), pair.char_to_token(at + b - 1, 1)
            if t0 is not None and t1 is not None:
                want.append((t0 + nb, t1 + nb + 1, v))
        got = list(zip(row["span_start"], row["span_end"], row["span_value"]))
        assert exact(got) == exact(want), (name, it.example.target)
        assert row["input_ids"] == enc.template.bos + pair.ids + enc.template.eos
