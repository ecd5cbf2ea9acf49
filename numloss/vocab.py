"""The numeric sub-vocabulary: which token ids are numbers, and what number each one is.

A `NumericVocab` is built once per tokenizer and shared by every loss. It holds N token ids with their
values (in the numeric-column order every loss uses), a lookup from vocab id to numeric column sized to
the logits width, and a per-(device, dtype) cache for the tables the losses derive from the values
(distance matrices, kernels), so that they are built once and live on the device.
"""

from __future__ import annotations

import math
import re
from typing import Callable, Hashable, Sequence

import torch

# Leading-space markers: GPT-2 byte-level BPE ("Ġ"), SentencePiece ("▁"), and tokenizers that keep a
# literal space. With `space_variants=True` a token "Ġ3" counts as the number 3.
SPACE_MARKERS = ("Ġ", "▁", " ")

POLICIES = ("digits", "integers", "float")

# The decimal point's token text (DEL groups digits and points into numbers).
DECIMAL_POINT = "."

# Only ASCII digits: `\d` would also accept "３" or "٣", and Python's float() would accept "1_000",
# "nan" and "inf". Exponents are left out on purpose: a token "e5" is not a number on its own.
# fullmatch, not match with "$": "$" also matches before a final newline, which made a token "3\n"
# numeric while "3 " was not.
_FLOAT_RE = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)")
_INTEGER_RE = re.compile(r"0|[1-9][0-9]*")
_DIGIT_RE = re.compile(r"[0-9]")
# The last character of every text the three patterns accept.
_NUMERIC_LAST = frozenset("0123456789.")


class NumericVocab:
    """N numeric tokens: `token_ids[i]` is a vocab id whose number is `values[i]`.

    Args:
        token_ids: distinct vocab ids, in the order of the numeric columns.
        values: the number each token stands for (duplicates allowed: " 3" and "3" may both be 3).
        vocab_size: the logits width V. Defaults to max(token_ids) + 1. It may be larger than the
            tokenizer (Qwen2.5 pads its logits to 151936 for 151665 tokens); every table is sized by it.
            Without it the vocabulary works with logits of any width above its largest id, dense or
            vocab-parallel (the TP shards tell the global width); with it, vocab-parallel logits whose
            shards tile another width are an error (`vocab_size_fixed`).
        name: how errors and reprs refer to this vocabulary (the tokenizer and policy it came from).
        decimal_point_id: the vocab id of the decimal point token ".", or None (DEL's place weights read
            it; `from_tokenizer` finds it). It must not be a numeric token.
    """

    def __init__(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        values: Sequence[float] | torch.Tensor,
        vocab_size: int | None = None,
        name: str = "NumericVocab",
        decimal_point_id: int | None = None,
    ):
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().cpu()
        vals = torch.as_tensor(values, dtype=torch.float64).flatten().cpu()
        if ids.numel() == 0:
            raise ValueError(f"{name}: a numeric vocabulary needs at least one token, got none")
        if ids.numel() != vals.numel():
            raise ValueError(f"{name}: {ids.numel()} token ids but {vals.numel()} values")
        if (ids < 0).any():
            raise ValueError(f"{name}: negative token id {int(ids[ids < 0][0])}")
        if ids.unique().numel() != ids.numel():
            uniq, counts = ids.unique(return_counts=True)
            raise ValueError(f"{name}: token id {int(uniq[counts > 1][0])} appears more than once")
        if not torch.isfinite(vals).all():
            raise ValueError(f"{name}: value {float(vals[~torch.isfinite(vals)][0])} is not finite")
        max_id = int(ids.max())
        # An explicit width is a claim about the model's logits that TP calls check; the default is not.
        self.vocab_size_fixed = vocab_size is not None
        if vocab_size is None:
            vocab_size = max_id + 1
        if max_id >= vocab_size:
            raise ValueError(f"{name}: token id {max_id} does not fit logits of width {vocab_size}")
        if decimal_point_id is not None:
            if isinstance(decimal_point_id, bool) or not hasattr(decimal_point_id, "__index__") or \
                    decimal_point_id.__index__() < 0:
                raise ValueError(f"{name}: decimal_point_id must be a token id (an int >= 0), got {decimal_point_id!r}")
            decimal_point_id = decimal_point_id.__index__()
            if self.vocab_size_fixed and decimal_point_id >= vocab_size:
                raise ValueError(f"{name}: decimal_point_id {decimal_point_id} does not fit logits of width {vocab_size}")
            if bool((ids == decimal_point_id).any()):
                raise ValueError(f"{name}: decimal_point_id {decimal_point_id} is one of the numeric tokens")
        self.decimal_point_id = decimal_point_id
        self.name = name
        self.token_ids = ids
        self.values = vals
        self.vocab_size = int(vocab_size)
        index = torch.full((self.vocab_size,), -1, dtype=torch.long)
        index[ids] = torch.arange(ids.numel())
        # index_of[id] is the numeric column of vocab id `id`, or -1 for a non-numeric token.
        self.index_of = index
        self._cache: dict = {}

    @property
    def size(self) -> int:
        """N, the number of numeric tokens."""
        return self.token_ids.numel()

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        lo, hi = float(self.values.min()), float(self.values.max())
        return f"NumericVocab({self.name}, N={self.size}, values in [{lo:g}, {hi:g}], V={self.vocab_size})"

    # ---- cached device tables -------------------------------------------------------------------
    def memo(self, key: Hashable, build: Callable[[], object]):
        """`build()`, computed once per key for the life of this vocabulary."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def cached(
        self, key: Hashable, device: torch.device | str, dtype: torch.dtype, build: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        """`build()` (a CPU tensor) moved to `device`/`dtype`, computed once per (key, device, dtype)."""
        device = torch.device(device)
        return self.memo((key, device, dtype), lambda: build().to(device=device, dtype=dtype))

    def ids_on(self, device) -> torch.Tensor:
        return self.cached("token_ids", device, torch.long, lambda: self.token_ids)

    def values_on(self, device, dtype=torch.float32) -> torch.Tensor:
        return self.cached("values", device, dtype, lambda: self.values)

    def index_on(self, device) -> torch.Tensor:
        return self.cached("index_of", device, torch.long, lambda: self.index_of)

    def distances(self, device, dtype=torch.float32, squash_factor: float | None = None) -> torch.Tensor:
        """[N, N] |v_i - v_j|, optionally squashed (see `squash_distances`)."""
        return self.cached(
            ("distances", squash_factor),
            device,
            dtype,
            lambda: squash_distances((self.values[:, None] - self.values[None, :]).abs(), squash_factor),
        )

    def is_digits(self) -> bool:
        """True when every value is one of the integers 0..9 (what NTIL's digit runs need)."""
        v = self.values
        return bool(((v == v.round()) & (v >= 0) & (v <= 9)).all())

    def is_ten_digits(self) -> bool:
        """True when the numeric tokens are exactly the ten digits 0..9, one token each (what DEL's ten
        digit logits need; a vocabulary with space variants has two tokens per digit)."""
        return self.size == 10 and self.is_digits() and self.values.unique().numel() == 10

    # ---- construction from a tokenizer ----------------------------------------------------------
    @classmethod
    def from_tokenizer(
        cls,
        tokenizer,
        policy: str = "digits",
        max_value: int = 999,
        space_variants: bool = False,
        vocab_size: int | None = None,
    ) -> "NumericVocab":
        """The numeric tokens of a Hugging Face tokenizer (or a `tokenizers.Tokenizer`) under `policy`.

        - "digits": the bare single characters "0".."9".
        - "integers": canonical integers 0..max_value ("7", "42", not "07") that are one token.
        - "float": every token whose text is a plain decimal number ("3", "0.5", "-2", ".5").

        Whatever the policy, the token whose text is exactly "." becomes `decimal_point_id` (None when the
        tokenizer has none, or when it lies beyond `vocab_size`).

        Tokens are read from the tokenizer's vocabulary (added tokens included), not by encoding, so the
        result does not depend on pre-tokenizer quirks. `space_variants=True` also counts a token with one
        leading space marker ("Ġ3", "▁3", " 3") as that number. `vocab_size` is the logits width; it
        defaults to the tokenizer's length and may be larger. Only a given `vocab_size` is checked against
        vocab-parallel shards (the tokenizer's length is a lower bound of the logits width, not the width).
        """
        width_given = vocab_size is not None
        if policy not in POLICIES:
            raise ValueError(f"unknown numeric policy {policy!r}; expected one of {POLICIES}")
        name = f"{_tokenizer_name(tokenizer)}/{policy}"
        if vocab_size is None:
            vocab_size = _tokenizer_length(tokenizer)
        ids, values = [], []
        # Every numeric token ends in a digit or "." ("3."): only such tokens are parsed and sorted, a few
        # thousand of a 128k-151k entry vocabulary (parsing and sorting all of it took ~0.2 s).
        entries = _tokenizer_vocab(tokenizer)
        candidates = [(i, t) for t, i in entries.items() if t[-1:] in _NUMERIC_LAST]
        for token_id, token in sorted(candidates):
            value = parse_numeric_token(token, policy, max_value, space_variants)
            if value is not None:
                ids.append(token_id)
                values.append(value)
        if not ids:
            raise ValueError(
                f"tokenizer {_tokenizer_name(tokenizer)} has no numeric token under policy {policy!r}"
                f" (space_variants={space_variants}); try another policy"
            )
        too_wide = [i for i in ids if i >= vocab_size]
        if too_wide:
            raise ValueError(
                f"{name}: numeric token id {too_wide[0]} does not fit logits of width {vocab_size}"
            )
        point = entries.get(DECIMAL_POINT)
        point = point if point is not None and point < vocab_size else None
        vocab = cls(ids, values, vocab_size=vocab_size, name=name, decimal_point_id=point)
        vocab.vocab_size_fixed = width_given
        return vocab


def parse_numeric_token(token: str, policy: str, max_value: int = 999, space_variants: bool = False):
    """The number a vocabulary entry stands for under `policy`, or None if it is not numeric."""
    if space_variants and token[:1] in SPACE_MARKERS and len(token) > 1:
        token = token[1:]
    if policy == "digits":
        return float(token) if _DIGIT_RE.fullmatch(token) else None
    if policy == "integers":
        if _INTEGER_RE.fullmatch(token) and int(token) <= max_value:
            return float(int(token))
        return None
    if policy == "float":
        if _FLOAT_RE.fullmatch(token):
            value = float(token)
            return value if math.isfinite(value) else None
        return None
    raise ValueError(f"unknown numeric policy {policy!r}; expected one of {POLICIES}")


def squash_distances(distances: torch.Tensor, squash_factor: float | None) -> torch.Tensor:
    """Map the non-zero distances linearly onto [1, squash_factor]; zeros stay zero.

    `1 + (D - min_nz)(s - 1) / (max - min_nz)`. For unit-spaced digits (min 1, max 9) and s = 9 this is the
    identity. None leaves distances as they are.
    """
    if squash_factor is None:
        return distances
    if squash_factor < 1:
        raise ValueError(f"squash_factor must be >= 1, got {squash_factor}")
    nonzero = distances[distances > 0]
    if nonzero.numel() == 0:
        return distances
    lo, hi = nonzero.min(), nonzero.max()
    if hi == lo:
        scaled = torch.ones_like(distances)
    else:
        scaled = 1 + (distances - lo) * (squash_factor - 1) / (hi - lo)
    return torch.where(distances > 0, scaled, torch.zeros_like(distances))


def _tokenizer_vocab(tokenizer) -> dict[str, int]:
    try:
        return tokenizer.get_vocab(with_added_tokens=True)  # tokenizers.Tokenizer
    except TypeError:
        return tokenizer.get_vocab()  # transformers tokenizers include added tokens already


def _tokenizer_length(tokenizer) -> int:
    if hasattr(tokenizer, "get_vocab_size"):
        return tokenizer.get_vocab_size(with_added_tokens=True)
    return len(tokenizer)


def _tokenizer_name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__

