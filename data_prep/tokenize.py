"""Examples -> token ids, labels masked on the prompt, and the numeric annotations the losses need.

Decisions (what a reader of a shard can rely on):
- Layout: `ids = tokenize(prefix) + tokenize(rest)`. The prefix is what the model sees at inference
  (the prompt, rendered by the chat template with its generation prompt); `rest` is the assistant
  turn (target text plus whatever the template puts around it, e.g. "<|im_end|>"). Tokenizing the
  two separately (as at inference, where the prompt is encoded alone) gives an exact label boundary:
  no token straddles prompt and target.
- Labels are aligned with `input_ids` (Hugging Face convention): `labels[i] = input_ids[i]` on the
  rest, -100 on the prefix. The loss shifts by one; nothing here is pre-shifted.
- Template: "auto" uses the tokenizer's chat template when it has one, else "plain". Plain is
  `[bos] + prompt + separator | target + [eos]` (bos/eos only if the tokenizer has them and
  add_bos/add_eos are on). With a chat template, BOS/EOS come from the template alone.
  A chat template is rendered once with sentinel strings and reused by string substitution (jinja per
  record costs more than the tokenizer); the substitution is checked against a real rendering on
  probes at start-up and on the first record of every chunk, and falls back to real rendering if a
  template turns out to touch its content (strip, conditionals).
- numeric_mask[i]: labels[i] != -100 and labels[i] is a numeric token of the `NumericVocab` built from
  the tokenizer with the configured policy (the losses' definition of a numeric position).
- Number spans: every number in the *target text* (digits with optional thousands separators and
  decimals, and a leading "-" that is a sign, not a binary minus), as token ranges [start, end) of the
  full sequence and its value (numbers.py). A span runs from the token that holds the number's first
  character to the one that holds its last: the tokenizer's char-to-token map, computed from the ids
  for byte-level tokenizers on ASCII text and from offsets otherwise (token_offsets.py). An example
  whose target's numbers are not decimal (`Example.number_spans=False`: a numeral in base 16) has no
  spans.
- Too long: a record longer than `max_length` tokens is rejected ("too_long"), never truncated:
  truncating would cut off the answer the numeric losses score.
- Only fast (Rust) tokenizers are supported: offsets and batch encoding need them.
- The template's own text (plain: the separator; chat: what the template writes around the prompt and
  the answer) must survive the tokenizer. A character of it that becomes the unknown token is refused
  when the Encoder is made, before any record is read: a tokenizer without "\n" (SentencePiece without
  byte fallback, WordPiece) turns the plain separator into `<unk>` in every row, which the model learns
  as part of every answer's context and never sees at inference; refused rather than warned, because
  the build would otherwise finish with the damage in every row and the warning long scrolled past.
  `allow_unk` (`--allow-unk`) builds anyway. A character that a tokenizer without an unknown token
  drops (a BPE with neither byte fallback nor that character; real tokenizers are byte-level or have
  one) is warned about: nothing stands in for it, and the tiny tokenizers of tests and demos are such.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from .numbers import find_numbers
from .sources.base import TOO_LONG, Example
from .token_offsets import ByteLengths, char_to_token, needs_offsets

IGNORE_INDEX = -100

# The shard schema of unpacked rows (see shards.py for the packed one).
ROW_SCHEMA = pa.schema([
    ("record", pa.int64()),            # index of the input record in the build's input stream
    ("example_id", pa.string()),       # "<source kind>/<ref>", e.g. "gsm8k/train.jsonl:12"
    ("input_ids", pa.list_(pa.int32())),
    ("labels", pa.list_(pa.int32())),
    ("numeric_mask", pa.list_(pa.bool_())),
    ("span_start", pa.list_(pa.int32())),
    ("span_end", pa.list_(pa.int32())),
    ("span_value", pa.list_(pa.float64())),
    ("answer", pa.float64()),
    ("answer_text", pa.string()),
    ("num_prompt_tokens", pa.int32()),
    ("num_tokens", pa.int32()),
    ("image", pa.binary()),
])


@dataclass
class TokenizeConfig:
    """How examples become token sequences. See the module docstring for the exact rules."""

    tokenizer: str  # hub name or local directory, loaded with transformers.AutoTokenizer
    revision: str | None = None
    template: str = "auto"  # "auto" | "chat" | "plain"
    system_prompt: str | None = None
    plain_separator: str = "\n"
    add_bos: bool = True
    add_eos: bool = True
    max_length: int = 4096
    numeric_policy: str = "digits"  # NumericVocab policy: "digits" | "integers" | "float"
    numeric_max_value: int = 999
    space_variants: bool = False
    template_fast_path: bool = True
    # build although the template's own text becomes the unknown token (or is dropped): decides whether a
    # build runs, not its bytes, so BuildConfig leaves it out of the build's identity
    allow_unk: bool = False


def load_tokenizer(cfg: TokenizeConfig):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg.tokenizer, revision=cfg.revision, use_fast=True)
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"tokenizer {cfg.tokenizer!r} has no fast (Rust) version; data_prep needs one")
    return tok


def tokenizer_fingerprint(tok) -> str:
    """sha256 over what decides the token ids: the backend JSON, the chat template, special tokens."""
    h = hashlib.sha256()
    h.update(tok.backend_tokenizer.to_str().encode())
    h.update(json.dumps(getattr(tok, "chat_template", None) or "", sort_keys=True).encode())
    special = {k: str(v) for k, v in sorted(tok.special_tokens_map.items())}
    h.update(json.dumps(special, sort_keys=True).encode())
    return h.hexdigest()


# ---- templates ---------------------------------------------------------------------------------
class PlainTemplate:
    """prefix = prompt + separator (nothing for an empty prompt); rest = target."""

    kind = "plain"

    def __init__(self, tok, cfg: TokenizeConfig):
        self.sep = cfg.plain_separator
        self.bos = [tok.bos_token_id] if cfg.add_bos and tok.bos_token_id is not None else []
        self.eos = [tok.eos_token_id] if cfg.add_eos and tok.eos_token_id is not None else []

    def render(self, prompt: str, target: str, check: bool = False) -> tuple[str, str, int]:
        return (prompt + self.sep if prompt else ""), target, 0

    def own_text(self) -> dict[str, str]:
        """The text this template adds to every record, by what it is."""
        return {"separator": self.sep} if self.sep else {}

    def render_batch(self, prompts: list[str], targets: list[str]) -> tuple[list[str], list[str], list[int] | None]:
        """(prefixes, rests, offsets of each target in its rest or None when all are 0)."""
        sep = self.sep
        return [p + sep if p else "" for p in prompts], targets, None


_P, _T = "\ue000PROMPT\ue000", "\ue001TARGET\ue001"  # private-use sentinels


class ChatTemplate:
    """The tokenizer's own chat template, rendered as user turn + assistant turn."""

    kind = "chat"

    def __init__(self, tok, cfg: TokenizeConfig):
        self.tok = tok
        self.system = cfg.system_prompt
        self.bos, self.eos = [], []  # the template writes its own special tokens
        self.fast = None
        if cfg.template_fast_path:
            self.fast = self._split_template()
            probes = [("What is 2+3?", "5"), ("  padded prompt \n", " 7 \n"), ("", "x")]
            try:
                if self.fast and any(self._render_fast(p, t) != self._render_slow(p, t) for p, t in probes):
                    self.fast = None
            except ValueError:
                self.fast = None

    def _messages(self, prompt: str, target: str | None):
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        msgs.append({"role": "user", "content": prompt})
        if target is not None:
            msgs.append({"role": "assistant", "content": target})
        return msgs

    def _render_slow(self, prompt: str, target: str) -> tuple[str, str, int]:
        prefix = self.tok.apply_chat_template(self._messages(prompt, None), tokenize=False,
                                              add_generation_prompt=True)
        full = self.tok.apply_chat_template(self._messages(prompt, target), tokenize=False)
        if not full.startswith(prefix):
            raise ValueError(
                f"chat template of {self.tok.name_or_path!r} renders the conversation with a different "
                "prefix than the prompt with add_generation_prompt=True; use template='plain'"
            )
        rest = full[len(prefix):]
        at = rest.find(target)
        if at < 0 and target.strip():
            # Templates that trim content (`| trim`): locate the stripped text. `at` stays relative to
            # the unstripped target (it may be negative) so char positions of numbers still line up.
            found = rest.find(target.strip())
            if found < 0:
                raise ValueError(f"chat template of {self.tok.name_or_path!r} alters the assistant text; "
                                 "use template='plain'")
            at = found - (len(target) - len(target.lstrip()))
        return prefix, rest, at

    def _split_template(self):
        try:
            prefix, rest, _ = self._render_slow(_P, _T)
        except ValueError:
            return None
        a = prefix.split(_P)
        b = rest.split(_T)
        if len(a) != 2 or len(b) != 2 or _P in rest:
            return None
        return a[0], a[1], b[0], b[1]

    def _render_fast(self, prompt: str, target: str) -> tuple[str, str, int]:
        a0, a1, b0, b1 = self.fast
        return a0 + prompt + a1, b0 + target + b1, len(b0)

    def render(self, prompt: str, target: str, check: bool = False) -> tuple[str, str, int]:
        if self.fast is None:
            return self._render_slow(prompt, target)
        out = self._render_fast(prompt, target)
        if check and out != self._render_slow(prompt, target):
            self.fast = None  # this template reacts to content: render every record from now on
            return self._render_slow(prompt, target)
        return out

    def own_text(self) -> dict[str, str]:
        """The text this template adds to every record, by where it stands (the system prompt included)."""
        if self.fast is not None:
            pieces = self.fast
        else:  # a template that reacts to its content: the text around a probe's prompt and answer
            prompt, target = "What is 2+3?", "5"
            prefix, rest, at = self._render_slow(prompt, target)
            pieces = (*prefix.split(prompt, 1), rest[:max(at, 0)], rest[max(at, 0) + len(target):])
        names = ("before the prompt", "after the prompt", "before the answer", "after the answer")
        return {name: text for name, text in zip(names, pieces) if text}

    def render_batch(self, prompts: list[str], targets: list[str]) -> tuple[list[str], list[str], list[int] | None]:
        """(prefixes, rests, offsets of each target in its rest); the first record is checked."""
        rendered = [self.render(p, t, check=(i == 0)) for i, (p, t) in enumerate(zip(prompts, targets))]
        return [r[0] for r in rendered], [r[1] for r in rendered], [r[2] for r in rendered]


def make_template(tok, cfg: TokenizeConfig):
    has_chat = bool(getattr(tok, "chat_template", None))
    if cfg.template == "chat" or (cfg.template == "auto" and has_chat):
        if not has_chat:
            raise ValueError(f"tokenizer {cfg.tokenizer!r} has no chat template; use template='plain'")
        return ChatTemplate(tok, cfg)
    if cfg.template in ("plain", "auto"):
        return PlainTemplate(tok, cfg)
    raise ValueError(f"unknown template {cfg.template!r}; expected 'auto', 'chat' or 'plain'")


def lost_template_text(tok, template) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """({where: characters} that the tokenizer turns into its unknown token, {where: characters} that it
    drops: no token's offsets cover them) of the template's own text, each piece encoded alone as the
    encoder encodes a prefix or a rest; both empty when every character is kept."""
    unk = tok.unk_token_id
    unknown: dict[str, list[str]] = {}
    dropped: dict[str, list[str]] = {}
    for where, text in template.own_text().items():
        enc = tok.backend_tokenizer.encode(text, add_special_tokens=False)
        kept = [None] * len(text)  # per character: the token that holds it, if any
        for token, (start, end) in zip(enc.ids, enc.offsets):
            kept[start:end] = [token] * (end - start)
        for found, chars in ((unknown, {c for c, t in zip(text, kept) if t is not None and t == unk}),
                             (dropped, {c for c, t in zip(text, kept) if t is None})):
            if chars:
                found[where] = sorted(chars)
    return unknown, dropped


def check_template_text(tok, template, cfg: TokenizeConfig) -> None:
    """Refuse (ValueError) a template whose own text becomes the unknown token, unless `cfg.allow_unk`;
    warn about characters of it that the tokenizer drops (one without an unknown token)."""
    unknown, dropped = lost_template_text(tok, template)

    def listed(lost: dict) -> str:
        return "; ".join(f"{where}: {', '.join(map(repr, chars))}" for where, chars in lost.items())

    fix = ("set plain_separator (--plain-separator) to text the tokenizer has, e.g. ' '"
           if template.kind == "plain" else "give the tokenizer those characters, or use template='plain'")
    if dropped:
        warnings.warn(f"data_prep: tokenizer {cfg.tokenizer!r} drops characters of the {template.kind} template's"
                      f" own text in every row ({listed(dropped)}); to keep them, {fix}", stacklevel=3)
    if unknown and not cfg.allow_unk:
        raise ValueError(
            f"data_prep: tokenizer {cfg.tokenizer!r} turns the {template.kind} template's own text into its unknown"
            f" token {tok.unk_token!r} ({listed(unknown)}) in every row, around the prompt and the answer. Either"
            f" {fix}, or pass allow_unk=True (--allow-unk) to build anyway")


# ---- the encoder -------------------------------------------------------------------------------
@dataclass
class Item:
    """An example on its way through the encoder, with where it came from."""

    record: int
    example_id: str
    example: Example


class Encoder:
    """Encodes lists of examples into a column batch (ROW_SCHEMA) plus rejects. One per process."""

    def __init__(self, cfg: TokenizeConfig, tokenizer=None):
        from numloss.vocab import NumericVocab

        self.cfg = cfg
        self.tok = tokenizer if tokenizer is not None else load_tokenizer(cfg)
        self.backend = self.tok.backend_tokenizer
        self.template = make_template(self.tok, cfg)
        check_template_text(self.tok, self.template, cfg)
        self.vocab = NumericVocab.from_tokenizer(self.tok, policy=cfg.numeric_policy,
                                                 max_value=cfg.numeric_max_value,
                                                 space_variants=cfg.space_variants)
        # index_of is sized by len(tokenizer); labels never exceed it.
        self.is_numeric = self.vocab.index_of.numpy() >= 0
        # Ids without offsets (tokenizers >= 0.20), else with them.
        self._encode_ids = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        # None: this tokenizer's numbers find their tokens through offsets (token_offsets.py).
        probes = [r for p, t in [("What is 2+3?", "5"), ("Total:", " -1,250.5 \n#### 7")]
                  for r in self.template.render(p, t)[:2]]
        self.byte_lengths = ByteLengths.of(self.backend, probes)

    def describe(self) -> dict[str, dict]:
        """The tokenizer and the numeric vocabulary as a build's header records them (plain JSON
        values: a worker process computes them for the main process)."""
        tok, vocab = self.tok, self.vocab
        return {
            "tokenizer": {
                "name": self.cfg.tokenizer,
                "fingerprint": tokenizer_fingerprint(tok),
                "length": len(tok),
                "pad_token_id": tok.pad_token_id,
                "bos_token_id": tok.bos_token_id,
                "eos_token_id": tok.eos_token_id,
                "template": self.template.kind,
            },
            "numeric_vocab": {
                "policy": self.cfg.numeric_policy,
                "size": vocab.size,
                "token_ids": vocab.token_ids.tolist(),
                "values": vocab.values.tolist(),
            },
        }

    def encode(self, items: list[Item]) -> tuple[pa.RecordBatch, list[dict[str, Any]]]:
        """The kept rows (in input order) and the rejects ({"record", "example_id", "reason", "detail"}).

        Batched: two tokenizer calls (prefixes, rests), one pass over the targets for their numbers and
        numpy for the columns; Python work per record is a few list operations.
        """
        exs = [it.example for it in items]
        prefixes, rests, ats = self.template.render_batch([e.prompt for e in exs], [e.target for e in exs])
        # Prefix and rest are encoded apart (the ids of a pair encoding, whose sequences are also
        # pre-tokenized apart). The prefix needs no offsets; a rest needs them only where its numbers
        # cannot find their tokens from the ids (token_offsets.py): offsets cost ~25% more tokenizer CPU.
        prefix_ids = [e.ids for e in self._encode_ids(prefixes, add_special_tokens=False)]
        rest_encs, offsets = self._encode_rests(rests)
        rest_ids = [e.ids for e in rest_encs]
        n_prefix = np.fromiter(map(len, prefix_ids), dtype=np.int64, count=len(items))
        n_rest = np.fromiter(map(len, rest_ids), dtype=np.int64, count=len(items))
        bos, eos = self.template.bos, self.template.eos
        lengths = n_prefix + n_rest + (len(bos) + len(eos))
        rejects = []
        too_long = lengths > self.cfg.max_length
        if too_long.any():
            for i in np.flatnonzero(too_long).tolist():
                rejects.append({"record": items[i].record, "example_id": items[i].example_id,
                                "reason": TOO_LONG,
                                "detail": f"{int(lengths[i])} tokens > max_length {self.cfg.max_length}"})
            keep_ix = np.flatnonzero(~too_long).tolist()
            items, exs, prefix_ids, rest_ids, rests, rest_encs, offsets = (
                [x[i] for i in keep_ix] for x in (items, exs, prefix_ids, rest_ids, rests, rest_encs, offsets))
            ats = [ats[i] for i in keep_ix] if ats is not None else None
            n_prefix, n_rest, lengths = n_prefix[keep_ix], n_rest[keep_ix], lengths[keep_ix]
        prefix_flat, rest_flat = (
            np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(counts.sum()))
            for ids, counts in ((prefix_ids, n_prefix), (rest_ids, n_rest)))
        with_offsets = {i: e for i, (e, o) in enumerate(zip(rest_encs, offsets)) if o}
        del rest_encs
        spans = self._spans(rests, rest_flat, n_rest, with_offsets,
                            [e.target if e.number_spans else "" for e in exs], ats)
        return self._columns(items, exs, prefix_flat, n_prefix, rest_flat, n_rest, lengths, *spans), rejects

    def _encode_rests(self, rests: list[str]) -> tuple[list, list[bool]]:
        """The rests' encodings and which of them carry offsets: only the rests whose numbers cannot
        find their tokens from the ids (`token_offsets.needs_offsets`) are encoded with them."""
        offsets = needs_offsets(self.byte_lengths, rests)
        encs: list = [None] * len(rests)
        for want, encode in ((False, self._encode_ids), (True, self.backend.encode_batch)):
            ix = [i for i, o in enumerate(offsets) if o is want]
            if ix:
                for i, e in zip(ix, encode([rests[i] for i in ix], add_special_tokens=False)):
                    encs[i] = e
        return encs, offsets

    def _spans(self, rests: list[str], rest_ids: np.ndarray, n_rest: np.ndarray, with_offsets: dict,
               targets: list[str], ats: list[int] | None):
        """Number spans of all targets: (per-record counts, first token, last token, values), token
        indices counted in each record's rest (`rest_ids`: the rests' ids concatenated, `n_rest` per
        rest, `with_offsets`: the rests encoded with offsets, by index).

        One pass over the targets joined by "\n": NUMBER_RE never crosses a newline and treats a "-"
        after one like a "-" at the start of a text, so it finds exactly each target's numbers.
        """
        n = len(targets)
        starts, ends, values = find_numbers("\n".join(targets))
        k = len(starts)
        if k == 0:
            return np.zeros(n, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), values
        text_start = np.zeros(n, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, targets), dtype=np.int64, count=n)[:-1] + 1, out=text_start[1:])
        rec = np.searchsorted(text_start, starts, side="right") - 1
        base = text_start[rec]
        if ats is not None:
            base = base - np.asarray(ats, dtype=np.int64)[rec]
        # The tokens holding the first and the last character of each number (char positions in the rest).
        tok = char_to_token(self.backend, self.byte_lengths, rests, rest_ids, n_rest,
                            np.concatenate([rec, rec]), np.concatenate([starts - base, ends - 1 - base]),
                            with_offsets)
        t0, t1 = tok[:k], tok[k:]
        found = (t0 >= 0) & (t1 >= 0)
        if not found.all():  # a normalizer dropped characters: skip those numbers
            t0, t1, values, rec = t0[found], t1[found], values[found], rec[found]
        return np.bincount(rec, minlength=n), t0, t1, values

    def _columns(self, items, exs, prefix_ids, n_prefix, rest_ids, n_rest, lengths, span_counts, s_start,
                 s_end, s_value) -> pa.RecordBatch:
        n = len(lengths)
        bos, eos = self.template.bos, self.template.eos
        nb, ne = len(bos), len(eos)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        total = int(offsets[-1])
        # Each row is bos + prefix + rest + eos: every token's place in the flat column.
        flat = np.empty(total, dtype=np.int32)
        starts = offsets[:-1]
        for j, t in enumerate(bos):
            flat[starts + j] = t
        for j, t in enumerate(eos):
            flat[offsets[1:] - ne + j] = t
        for ids, counts, at in ((prefix_ids, n_prefix, starts + nb), (rest_ids, n_rest, starts + nb + n_prefix)):
            flat[np.arange(len(ids), dtype=np.int64) + np.repeat(at - (np.cumsum(counts) - counts), counts)] = ids
        # Position of each token inside its example: prompt positions get -100.
        prompt = (n_prefix + nb).astype(np.int32)
        pos = np.arange(total, dtype=np.int32) - np.repeat(offsets[:-1].astype(np.int32), lengths)
        in_prompt = pos < np.repeat(prompt, lengths)
        labels = np.where(in_prompt, IGNORE_INDEX, flat).astype(np.int32)
        numeric = ~in_prompt & self.is_numeric[flat]

        span_offs = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(span_counts, out=span_offs[1:])
        # Token indices are counted in the rest: shift by the BOS ids and the prefix in front.
        span_shift = np.repeat(prompt, span_counts)
        s_start = np.asarray(s_start, dtype=np.int32) + span_shift
        s_end = np.asarray(s_end, dtype=np.int32) + span_shift + 1
        off = _prim(offsets.astype(np.int32), pa.int32())
        soff = _prim(span_offs, pa.int32())
        # Arrays are built from buffers: pa.array on Python objects imports pandas (about 0.3 s per
        # process) and checks every value; these are already typed.
        return pa.RecordBatch.from_arrays([
            _prim(np.fromiter((it.record for it in items), dtype=np.int64, count=n), pa.int64()),
            _strings([it.example_id for it in items], pa.string()),
            pa.ListArray.from_arrays(off, _prim(flat, pa.int32())),
            pa.ListArray.from_arrays(off, _prim(labels, pa.int32())),
            pa.ListArray.from_arrays(off, _bools(numeric)),
            pa.ListArray.from_arrays(soff, _prim(s_start, pa.int32())),
            pa.ListArray.from_arrays(soff, _prim(s_end, pa.int32())),
            pa.ListArray.from_arrays(soff, _prim(s_value, pa.float64())),
            _floats([e.answer for e in exs]),
            _strings([e.answer_text for e in exs], pa.string()),
            _prim(prompt, pa.int32()),
            _prim(lengths.astype(np.int32), pa.int32()),
            _strings([e.image for e in exs], pa.binary()),
        ], schema=ROW_SCHEMA)


def _validity(valid: np.ndarray) -> pa.Buffer | None:
    return None if valid.all() else pa.py_buffer(np.packbits(valid, bitorder="little"))


def _prim(values: np.ndarray, typ: pa.DataType) -> pa.Array:
    """A null-free fixed-width array over `values` (numpy, already of the type's width)."""
    return pa.Array.from_buffers(typ, len(values), [None, pa.py_buffer(np.ascontiguousarray(values))])


def _bools(values: np.ndarray) -> pa.Array:
    return pa.Array.from_buffers(pa.bool_(), len(values), [None, pa.py_buffer(np.packbits(values, bitorder="little"))])


def _floats(values: list[float | None]) -> pa.Array:
    """float64 with None as null (what pa.array makes of such a list; ints and bools become floats)."""
    n = len(values)
    valid = np.fromiter((v is not None for v in values), dtype=bool, count=n)
    data = np.fromiter((0.0 if v is None else v for v in values), dtype=np.float64, count=n)
    return pa.Array.from_buffers(pa.float64(), n, [_validity(valid), pa.py_buffer(data)])


def _strings(values: list[str | bytes | None], typ: pa.DataType) -> pa.Array:
    """string (utf-8) or binary with None as null, from one joined buffer and its offsets."""
    n = len(values)
    valid = np.fromiter((v is not None for v in values), dtype=bool, count=n)
    if typ == pa.string():
        raw = [b"" if v is None else v.encode("utf-8") for v in values]
    else:
        raw = [b"" if v is None else bytes(v) for v in values]
    offs = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(np.fromiter(map(len, raw), dtype=np.int64, count=n), out=offs[1:])
    return pa.Array.from_buffers(typ, n, [_validity(valid), pa.py_buffer(offs), pa.py_buffer(b"".join(raw))])
