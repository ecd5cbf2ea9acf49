"""token_offsets.char_to_token against the tokenizer's own offsets (`Encoding.char_to_token`), at every
character of random ASCII and non-ASCII texts, for tokenizers the byte-length rule covers and ones it
must refuse (SentencePiece-style, a prefix space, a normalizer that is not a normal form, an added
token that swallows its neighbour)."""

import random

import pytest
from tests.data_prep.test_numbers import ATOMS, CHARS, random_text
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from data_prep.token_offsets import ByteLengths, char_to_token

ASCII_CHARS = [c for c in CHARS if c.isascii()]


def ascii_text(rng: random.Random) -> str:
    return "".join(rng.choice([a for a in ATOMS if a.isascii()]) if rng.random() < 0.4 else rng.choice(ASCII_CHARS)
                   for _ in range(rng.randint(0, 30)))


def texts(seed: int, extra: tuple[str, ...] = ()) -> list[str]:
    rng = random.Random(seed)
    return ([ascii_text(rng) for _ in range(150)] + [random_text(rng, True) for _ in range(50)]
            + ["", " ", "  12  ", "\n#### -1,600\n", *extra])


def reference(tok: Tokenizer, batch: list[str]) -> list[list[int | None]]:
    return [[e.char_to_token(c) for c in range(len(t))] for t, e in
            zip(batch, tok.encode_batch(batch, add_special_tokens=False))]


def lookup(tok: Tokenizer, byte_lengths, batch: list[str]):
    """(ours at every character, which characters took the byte-length path)."""
    import numpy as np

    encs = tok.encode_batch_fast(batch, add_special_tokens=False)
    counts = np.array([len(e.ids) for e in encs], dtype=np.int64)
    ids = np.array([i for e in encs for i in e.ids], dtype=np.int64)
    rec = np.repeat(np.arange(len(batch)), [len(t) for t in batch])
    pos = np.concatenate([np.arange(len(t)) for t in batch])
    got = char_to_token(tok, byte_lengths, batch, ids, counts, rec, pos).tolist()
    fast = byte_lengths.locate(batch, ids, counts, rec, pos)[0].tolist() if byte_lengths else [False] * len(pos)
    out, took, i = [], [], 0
    for t in batch:
        out.append(got[i:i + len(t)])
        took.append(fast[i:i + len(t)])
        i += len(t)
    return out, took


def check_agrees(tok: Tokenizer, batch: list[str], byte_lengths) -> int:
    """Every character: offsets' token where they name one; a token of ours (never -1) on the
    byte-length path, and -1 exactly where offsets name none on the offsets path. Returns how many
    texts took the byte-length path."""
    want = reference(tok, batch)
    got, took = lookup(tok, byte_lengths, batch)
    fast_texts = 0
    for t, w, g, f in zip(batch, want, got, took):
        for c, (wc, gc, fc) in enumerate(zip(w, g, f)):
            if fc:
                assert gc >= 0 and (wc is None and t[c].isspace() or gc == wc), (t, c)
            else:
                assert gc == (-1 if wc is None else wc), (t, c)
        fast_texts += bool(f) and all(f)
    return fast_texts


def byte_level(trained_on: list[str], **pre) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(**{"add_prefix_space": False, **pre})
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(trained_on, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|im_end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


@pytest.fixture(scope="module")
def corpus():
    return texts(0)


@pytest.mark.parametrize("name", ["digits-plain", "llama3-chat", "real-llama3", "real-qwen"])
def test_byte_level_tokenizers_take_the_byte_length_path_and_agree(name, tokenizers_dir, real_size_toks, corpus):
    from transformers import AutoTokenizer

    path = real_size_toks[name[5:]] if name.startswith("real-") else tokenizers_dir[name]
    tok = AutoTokenizer.from_pretrained(path).backend_tokenizer
    byte_lengths = ByteLengths.of(tok)
    assert byte_lengths is not None, "a byte-level BPE must not pay for offsets"
    batch = corpus + ["<|im_end|>12<|im_end|>\n 3", "Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72"]
    fast = check_agrees(tok, batch, byte_lengths)
    n_ascii = sum(t.isascii() and len(t) > 0 for t in batch)
    assert fast == n_ascii  # every non-empty ASCII text, and no other, took the byte-length path


def test_a_normal_form_normalizer_keeps_the_rule_and_non_ascii_goes_through_offsets(corpus):
    tok = byte_level(corpus)
    tok.normalizer = normalizers.NFC()
    byte_lengths = ByteLengths.of(tok)
    assert byte_lengths is not None
    assert check_agrees(tok, corpus + ["cafe\u0301 12", "e\u0301-3"], byte_lengths) > 100


@pytest.mark.parametrize("kind", ["sentencepiece", "prefix-space", "lowercase"])
def test_tokenizers_the_rule_does_not_cover_use_offsets_and_agree(kind, corpus):
    if kind == "sentencepiece":  # Llama-2 / Mistral style: "▁" for spaces, a decoder that is not byte-level
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"]))
    elif kind == "prefix-space":  # every text gains a character the offsets do not hold
        tok = byte_level(corpus, add_prefix_space=True)
    else:
        tok = byte_level(corpus)
        tok.normalizer = normalizers.Lowercase()
    assert ByteLengths.of(tok) is None
    assert check_agrees(tok, corpus, None) == 0


def test_an_added_token_that_swallows_a_space_sends_its_text_through_offsets(corpus):
    tok = byte_level(corpus)
    tok.add_special_tokens([AddedToken("<|x|>", lstrip=True, special=True)])
    byte_lengths = ByteLengths.of(tok)
    assert byte_lengths is not None  # the probes hold no <|x|>
    batch = ["a 12 <|x|> 34", "12<|x|>5", "7 8"]
    _, took = lookup(tok, byte_lengths, batch)
    assert [all(f) for f in took] == [False, True, True]  # " <|x|>" is 6 characters held by a 5-byte token
    check_agrees(tok, batch, byte_lengths)


class CountingTokenizer:
    """A tokenizers.Tokenizer that counts the texts each encoding call gets."""

    def __init__(self, tok: Tokenizer):
        self.tok, self.texts = tok, {"encode_batch": 0, "encode_batch_fast": 0}

    def __getattr__(self, name):
        attr = getattr(self.tok, name)
        if name in self.texts:
            def counted(batch, **kw):
                self.texts[name] += len(batch)
                return attr(batch, **kw)
            return counted
        return attr


@pytest.mark.parametrize("kind", ["sentencepiece", "byte-level"])
def test_the_encoder_encodes_each_text_once_and_only_where_needed_with_offsets(kind, corpus):
    """A prefix is encoded once without offsets; a rest once, with offsets only where the byte-length
    rule cannot place its numbers (every rest of a SentencePiece-style tokenizer, the non-ASCII rests of
    a byte-level one); the spans are those of the offsets path."""
    from transformers import PreTrainedTokenizerFast

    from data_prep.sources.base import Example
    from data_prep.tokenize import Encoder, Item, TokenizeConfig

    if kind == "sentencepiece":
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"]))
    else:
        tok = byte_level(corpus)
    enc = Encoder(TokenizeConfig("local", template="plain"), tokenizer=PreTrainedTokenizerFast(tokenizer_object=tok))
    assert (enc.byte_lengths is None) == (kind == "sentencepiece")
    rng = random.Random(5)
    items = [Item(i, f"t/{i}", Example(prompt=ascii_text(rng) or "q", target=t or "0", answer=1.0))
             for i, t in enumerate(texts(6))]
    counting = CountingTokenizer(tok)
    enc.backend, enc._encode_ids = counting, counting.encode_batch_fast
    batch, _ = enc.encode(items)
    non_ascii = sum(not it.example.target.isascii() for it in items)
    with_offsets = len(items) if kind == "sentencepiece" else non_ascii
    assert 0 < non_ascii < len(items)
    assert counting.texts == {"encode_batch": with_offsets, "encode_batch_fast": 2 * len(items) - with_offsets}
    enc.backend, enc.byte_lengths = tok, None  # the offsets path for every rest: the same rows
    enc._encode_ids = tok.encode_batch_fast
    assert enc.encode(items)[0].equals(batch)
