"""Small tokenizers trained inside the tests (no downloads), and tiny hand-made numeric vocabularies.

Importable from any test module:

    from tests.numloss.tokenizers_fixture import digit_tokenizer, llama3_tokenizer, as_fast, ...

Every builder is cached (`functools.lru_cache`): a tokenizer is trained at most once per process. The
`tokenizers.Tokenizer` objects are not mutated by numloss; do not mutate them in a test either.

Builders:
- `digit_tokenizer()`       Qwen-style: BPE with `Digits(individual_digits=True)`: numbers are single digits.
- `llama3_tokenizer()`      Llama-3-style: BPE with a `Split(\\d{1,3})` pre-tokenizer, trained on every
                            integer 0..999, so its vocab has exactly 1000 canonical integer tokens.
- `sentencepiece_tokenizer()` Metaspace ("▁3") BPE.
- `byte_level_tokenizer()`  GPT-2 byte-level ("Ġ3") BPE.
- `no_number_tokenizer()`   WordLevel without any numeric token.
- `word_level(tokens)`      a WordLevel tokenizer whose vocabulary is exactly `tokens` (ids in order).
- `as_fast(tok)`            wrap in `transformers.PreTrainedTokenizerFast`.
"""

from __future__ import annotations

import functools

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

UNK = "<unk>"

_WORDS = "the cat has apples and pears , . - of in total sum is what answer".split()


def _word_corpus(lines: int = 20) -> list[str]:
    return [" ".join(_WORDS[(i + k) % len(_WORDS)] for k in range(8)) for i in range(lines)]


def _bpe(pre_tokenizer, corpus: list[str], vocab_size: int, decoder=None, byte_level: bool = False) -> Tokenizer:
    """A BPE tokenizer trained on `corpus` behind `pre_tokenizer`: with `<unk>`, or over the 256-byte
    alphabet (`byte_level`, which needs no unknown token)."""
    tok = Tokenizer(models.BPE() if byte_level else models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizer
    if decoder is not None:
        tok.decoder = decoder
    extra = {"initial_alphabet": pre_tokenizers.ByteLevel.alphabet()} if byte_level else {"special_tokens": [UNK]}
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, show_progress=False,
                                                        **extra))
    return tok


@functools.lru_cache(maxsize=None)
def digit_tokenizer() -> Tokenizer:
    """Qwen-style: every digit is its own token (numbers are runs of the ten digit tokens)."""
    split = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)])
    return _bpe(split, _word_corpus() + ["I have 407 apples and 12.5 pears, -3 figs: 0123456789 9876543210"] * 5, 300)


@functools.lru_cache(maxsize=None)
def llama3_tokenizer() -> Tokenizer:
    """Llama-3-style: numbers split in groups of up to three digits; every integer 0..999 is one token."""
    split = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\d{1,3}"), behavior="isolated"),
                                     pre_tokenizers.Whitespace()])
    integers = [" ".join(str(i) for i in range(k, k + 50)) for k in range(0, 1000, 50)]
    return _bpe(split, integers + _word_corpus(), 4000)


@functools.lru_cache(maxsize=None)
def sentencepiece_tokenizer() -> Tokenizer:
    """SentencePiece-like (Metaspace): a number after a space becomes a "▁3" token; bare digits exist too."""
    corpus = ["I have 3 apples and 5 pears 7 figs 0 1 2 3 4 5 6 7 8 9 x0 x1 x2 x3 x4 x5 x6 x7 x8 x9"] * 10
    return _bpe(pre_tokenizers.Metaspace(), corpus, 300, decoders.Metaspace())


@functools.lru_cache(maxsize=None)
def byte_level_tokenizer() -> Tokenizer:
    """GPT-2 byte-level BPE: " 3" becomes "Ġ3"; the byte alphabet also holds "²", "³", "¹" (not numbers)."""
    corpus = ["I have 3 apples and 5 pears, 7 figs 3 5 7 1 2 4 6 8 9 0 x0 x1 x2 x3 x4 x5 x6 x7 x8 x9"] * 10
    return _bpe(pre_tokenizers.ByteLevel(add_prefix_space=False), corpus, 400, decoders.ByteLevel(), byte_level=True)


def word_level(tokens: tuple[str, ...] | list[str]) -> Tokenizer:
    """A WordLevel tokenizer whose vocabulary is exactly `tokens`, token i having id i."""
    tokens = list(tokens)
    if UNK not in tokens:
        raise ValueError("word_level needs the <unk> token in its list")
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


@functools.lru_cache(maxsize=None)
def no_number_tokenizer() -> Tokenizer:
    return word_level((UNK, "the", "cat", "sat", ".", "-", "²", "e5", "nan", "inf"))


def as_fast(tok: Tokenizer, name: str | None = None):
    """`transformers.PreTrainedTokenizerFast` around a `tokenizers.Tokenizer` (optionally named)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=UNK if UNK in tok.get_vocab() else None)
    if name is not None:
        fast.name_or_path = name
    return fast


def digit_ids(tok) -> dict[int, int]:
    """{digit: token id} for the bare "0".."9" tokens of a tokenizer."""
    vocab = tok.get_vocab()
    return {d: vocab[str(d)] for d in range(10)}
