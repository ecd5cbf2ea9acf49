"""Which token of an encoded text holds a given character: how number spans find their tokens.

The tokenizer's offsets answer it (`Encoding.char_to_token`), but a byte-level BPE tokenizer
(Llama-3, Qwen2.5, GPT-2, SmolLM2) spends about a quarter of its time computing offsets, and a
lookup is a Python call per number end. For byte-level tokenizers the ids alone answer it: a token
stands for the bytes of its string (one byte per character of the byte-level alphabet; an added
token, such as "<|im_end|>", for its content), so on ASCII text, where a byte is a character, the
tokens' lengths summed in order give where each token ends, and the token holding character c is
the first that ends after c. That is a cumulative sum and a binary search over a chunk at once.

Decisions:
- Only where it is exact. `ByteLengths.of(tokenizer)` exists only for a tokenizer whose decoder is
  byte-level and whose normalizer is none or a Unicode normal form (the identity on ASCII), and only
  if on probe texts every character maps to the token that the tokenizer's own offsets give. A text
  takes the fast path only if it is ASCII and its tokens' lengths add up to its length (nothing was
  added or dropped, as a prefix space or an added token that strips its neighbours would).
- Everything else (other tokenizers, non-ASCII texts) is encoded with offsets, once (`needs_offsets`
  says which before encoding), and looked up with `char_to_token`, which gives the same answer by
  definition (tested: both paths, every character, on byte-level and SentencePiece-style
  tokenizers). Only an ASCII text whose lengths do not add up is encoded a second time.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

# Unicode normal forms: the identity on ASCII text.
_ASCII_IDENTITY_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD"}

# Texts the byte-length rule is checked on before it is used: numbers in every form the spans use,
# leading and repeated spaces, newlines and tabs, punctuation, and the template's own tokens.
_PROBES = ["What is 12 + 7?\n19", " -3 = 5 - 8, so 1,250 + 350 = 1,600\n#### 1,600",
           "  padded\t 0.25 and 3:05 \n\n x2 (-7) [42] 100%  ", "a-5b 1e3 $12.50 +4 #### -12"]


def _component_types(obj) -> list[str]:
    """The types of a normalizer or decoder, and of its members if it is a Sequence."""
    if obj is None:
        return []
    state = json.loads(obj.__getstate__())
    members = state.get("normalizers") or state.get("decoders")
    return [m["type"] for m in members] if state.get("type") == "Sequence" and members else [state["type"]]


class ByteLengths:
    """`lengths[id]`: the bytes of text that token `id` stands for, for a byte-level tokenizer."""

    def __init__(self, lengths: np.ndarray):
        self.lengths = lengths

    @classmethod
    def of(cls, backend, probes: list[str] = ()) -> "ByteLengths | None":
        """The byte lengths of `backend`'s tokens (a `tokenizers.Tokenizer`), or None when the rule
        does not hold for it. `probes`: more texts to check it on (the template's renderings)."""
        if _component_types(backend.decoder) != ["ByteLevel"]:
            return None
        if not set(_component_types(backend.normalizer)) <= _ASCII_IDENTITY_NORMALIZERS:
            return None
        vocab = backend.get_vocab(with_added_tokens=True)
        lengths = np.zeros(max(vocab.values()) + 1, dtype=np.int64)
        lengths[np.fromiter(vocab.values(), dtype=np.int64, count=len(vocab))] = np.fromiter(
            map(len, vocab), dtype=np.int64, count=len(vocab))  # one byte per byte-level character
        for i, added in backend.get_added_tokens_decoder().items():
            lengths[i] = len(added.content.encode("utf-8"))
        self = cls(lengths)
        texts = [t for t in [*_PROBES, *probes] if t.isascii()]
        encs = backend.encode_batch(texts, add_special_tokens=False)
        ids = [e.ids for e in encs]
        counts = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter((i for x in ids for i in x), dtype=np.int64, count=int(counts.sum()))
        fast, got = self.locate(texts, flat, counts, *_every_char(texts))
        if not fast.all():
            return None
        want = [e.char_to_token(c) for e, t in zip(encs, texts) for c in range(len(t))]
        # Offsets leave some whitespace to no token (trim_offsets); where they name one, it must agree.
        if any(w is not None and w != g for w, g in zip(want, got.tolist())):
            return None
        return self

    def locate(self, texts: list[str], ids: np.ndarray, counts: np.ndarray, rec: np.ndarray,
               pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For character `pos[i]` of text `rec[i]`: (whether the rule applies to that text, the index
        among that text's tokens of the token holding it; -1 where the rule does not apply).
        `ids`: every text's token ids concatenated; `counts`: how many each text has."""
        n = len(texts)
        first = np.zeros(n + 1, dtype=np.int64)  # each text's first token in `ids`
        np.cumsum(counts, out=first[1:])
        ends = np.cumsum(self.lengths[ids])  # where each token ends, counting every text before it
        at = np.concatenate([[0], ends])[first]  # the bytes of all texts before text r, and after
        text_len = np.fromiter(map(len, texts), dtype=np.int64, count=n)
        exact = np.fromiter(map(str.isascii, texts), dtype=bool, count=n) & (np.diff(at) == text_len)
        fast = exact[rec]
        token = np.full(len(pos), -1, dtype=np.int64)
        r = rec[fast]
        token[fast] = np.searchsorted(ends, at[r] + pos[fast], side="right") - first[r]
        return fast, token


def _every_char(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    rec = np.repeat(np.arange(len(texts)), [len(t) for t in texts])
    pos = np.concatenate([np.arange(len(t)) for t in texts])
    return rec, pos


def needs_offsets(byte_lengths: ByteLengths | None, texts: list[str]) -> list[bool]:
    """Which texts the byte-length rule cannot cover before they are encoded (all of them without
    the rule, else the non-ASCII ones): encode those with offsets, once, and pass them to
    `char_to_token`."""
    return [True] * len(texts) if byte_lengths is None else [not t.isascii() for t in texts]


def char_to_token(backend, byte_lengths: ByteLengths | None, texts: list[str], ids: np.ndarray,
                  counts: np.ndarray, rec: np.ndarray, pos: np.ndarray,
                  with_offsets: dict[int, Any] | None = None) -> np.ndarray:
    """For character `pos[i]` of text `rec[i]`: the index among that text's tokens of the token that
    holds it, or -1 where no token does (a normalizer dropped it). `ids`, `counts`: the texts' token
    ids concatenated and how many each has (from `backend`, without special tokens).
    `with_offsets`: the encodings, with offsets, of texts already encoded so (by index). A text the
    byte-length rule does not cover is looked up in its encoding there, or encoded again with offsets
    if it has none (an ASCII text whose tokens' lengths do not add up)."""
    if byte_lengths is not None:
        fast, token = byte_lengths.locate(texts, ids, counts, rec, pos)
    else:
        fast, token = np.zeros(len(pos), dtype=bool), np.full(len(pos), -1, dtype=np.int64)
    slow = np.flatnonzero(~fast)
    if len(slow):
        encs = dict(with_offsets or {})
        again = [r for r in np.unique(rec[slow]).tolist() if r not in encs]
        encs.update(zip(again, backend.encode_batch([texts[r] for r in again], add_special_tokens=False)))
        found = [encs[r].char_to_token(p) for r, p in zip(rec[slow].tolist(), pos[slow].tolist())]
        token[slow] = [-1 if t is None else t for t in found]
    return token
