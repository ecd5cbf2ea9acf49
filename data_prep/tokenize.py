"""Examples -> token ids, labels masked on the prompt, and the numeric annotations the losses need.

Decisions (what a reader of a shard can rely on):
- Layout: `ids = tokenize(prefix) + tokenize(rest)` (one pair encoding). The prefix is what the model sees at inference
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
  full sequence and its value. Tokens are found through the tokenizer's char-to-token map, so a span
  covers every token that holds one of the number's characters.
- Too long: a record longer than `max_length` tokens is rejected ("too_long"), never truncated:
  truncating would cut off the answer the numeric losses score.
- Only fast (Rust) tokenizers are supported: offsets and batch encoding need them.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from .sources.base import TOO_LONG, Example

IGNORE_INDEX = -100

# Numbers in target text. A "-" counts as a sign only at the start or after a space/bracket/operator,
# so "5-3" is 5 and 3, while "-3" and "= -3" are -3.
# Same matches as r"(?:(?<![\w)\].])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?", written to start with a
# character class so the regex engine can skip quickly to candidates (about 25% faster on long texts).
NUMBER_RE = re.compile(
    r"[-\d](?:(?<=-)(?<![\w)\].]-)(?:\d{1,3}(?:,\d{3})+|\d+)|(?<=\d)(?:\d{0,2}(?:,\d{3})+|\d*))(?:\.\d+)?"
)

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


def number_spans(text: str) -> list[tuple[int, int, float]]:
    """(char start, char end, value) of every number in `text`."""
    return [(m.start(), m.end(), float(m.group().replace(",", ""))) for m in NUMBER_RE.finditer(text)]


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


def make_template(tok, cfg: TokenizeConfig):
    has_chat = bool(getattr(tok, "chat_template", None))
    if cfg.template == "chat" or (cfg.template == "auto" and has_chat):
        if not has_chat:
            raise ValueError(f"tokenizer {cfg.tokenizer!r} has no chat template; use template='plain'")
        return ChatTemplate(tok, cfg)
    if cfg.template in ("plain", "auto"):
        return PlainTemplate(tok, cfg)
    raise ValueError(f"unknown template {cfg.template!r}; expected 'auto', 'chat' or 'plain'")


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
        self.vocab = NumericVocab.from_tokenizer(self.tok, policy=cfg.numeric_policy,
                                                 max_value=cfg.numeric_max_value,
                                                 space_variants=cfg.space_variants)
        # index_of is sized by len(tokenizer); labels never exceed it.
        self.is_numeric = self.vocab.index_of.numpy() >= 0

    def encode(self, items: list[Item]) -> tuple[pa.RecordBatch, list[dict[str, Any]]]:
        """The kept rows (in input order) and the rejects ({"record", "example_id", "reason", "detail"})."""
        rendered = [self.template.render(it.example.prompt, it.example.target, check=(i == 0))
                    for i, it in enumerate(items)]
        # One call, prefix and rest as the two sequences of a pair: each is pre-tokenized on its own
        # (the same ids as two separate encodings) and token indices come out global.
        encs = self.backend.encode_batch([(r[0], r[1]) for r in rendered], add_special_tokens=False)
        bos, eos = self.template.bos, self.template.eos
        nb, max_len = len(bos), self.cfg.max_length
        finditer = NUMBER_RE.finditer

        keep, rejects, ids_list, prompt_lens = [], [], [], []
        span_counts, s_start, s_end, s_value = [], [], [], []
        for it, (prefix, _, at), enc in zip(items, rendered, encs):
            ids = enc.ids
            if bos or eos:
                ids = bos + ids + eos
            if len(ids) > max_len:
                rejects.append({"record": it.record, "example_id": it.example_id, "reason": TOO_LONG,
                                "detail": f"{len(ids)} tokens > max_length {max_len}"})
                continue
            c2t = enc.char_to_token
            first = c2t(0, 1)  # the first token of the rest; the slow way only if char 0 has none
            if first is None:
                seq = enc.sequence_ids
                first = seq.index(1) if 1 in seq else len(seq)
            n_prompt = nb + first
            # The hot spot of a build on number-dense text: list comprehensions, no per-number branches.
            target = it.example.target
            spans = [m.span() for m in finditer(target)]
            k = len(spans)
            if k:
                t0 = [c2t(at + a, 1) for a, _ in spans]
                t1 = [c2t(at + b - 1, 1) for _, b in spans]
                texts = [target[a:b] for a, b in spans]
                if None in t0 or None in t1:  # a normalizer dropped characters: skip those numbers
                    keep_ix = [j for j in range(k) if t0[j] is not None and t1[j] is not None]
                    t0, t1, texts = [t0[j] for j in keep_ix], [t1[j] for j in keep_ix], [texts[j] for j in keep_ix]
                    k = len(keep_ix)
                s_start.extend(t0)
                s_end.extend(t1)
                s_value.extend(texts)
            span_counts.append(k)
            keep.append(it)
            ids_list.append(ids)
            prompt_lens.append(n_prompt)
        return self._columns(keep, ids_list, prompt_lens, span_counts, s_start, s_end, s_value), rejects

    def _columns(self, keep, ids_list, prompt_lens, span_counts, s_start, s_end, s_value) -> pa.RecordBatch:
        n = len(ids_list)
        lengths = np.fromiter(map(len, ids_list), dtype=np.int32, count=n)
        offsets = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.fromiter(itertools.chain.from_iterable(ids_list), dtype=np.int32, count=int(offsets[-1]))
        # Position of each token inside its example: prompt positions get -100.
        prompt = np.asarray(prompt_lens, dtype=np.int32)
        pos = np.arange(len(flat), dtype=np.int32) - np.repeat(offsets[:-1], lengths)
        in_prompt = pos < np.repeat(prompt, lengths)
        labels = np.where(in_prompt, IGNORE_INDEX, flat).astype(np.int32)
        numeric = ~in_prompt & self.is_numeric[flat]

        span_offs = pa.array(np.concatenate([[0], np.cumsum(span_counts, dtype=np.int32)]).astype(np.int32))
        # Token indices come from the pair encoding (prefix first): shift by the BOS ids added in front.
        nb = len(self.template.bos)
        s_start = np.asarray(s_start, dtype=np.int32) + nb
        s_end = np.asarray(s_end, dtype=np.int32) + nb + 1
        s_value = np.array([float(t.replace(",", "")) for t in s_value], dtype=np.float64)
        off = pa.array(offsets)
        exs = [it.example for it in keep]
        return pa.RecordBatch.from_arrays([
            pa.array([it.record for it in keep], type=pa.int64()),
            pa.array([it.example_id for it in keep], type=pa.string()),
            pa.ListArray.from_arrays(off, pa.array(flat, type=pa.int32())),
            pa.ListArray.from_arrays(off, pa.array(labels, type=pa.int32())),
            pa.ListArray.from_arrays(off, pa.array(numeric, type=pa.bool_())),
            pa.ListArray.from_arrays(span_offs, pa.array(s_start, type=pa.int32())),
            pa.ListArray.from_arrays(span_offs, pa.array(s_end, type=pa.int32())),
            pa.ListArray.from_arrays(span_offs, pa.array(s_value, type=pa.float64())),
            pa.array([e.answer for e in exs], type=pa.float64()),
            pa.array([e.answer_text for e in exs], type=pa.string()),
            pa.array(prompt, type=pa.int32()),
            pa.array(lengths, type=pa.int32()),
            pa.array([e.image for e in exs], type=pa.binary()),
        ], schema=ROW_SCHEMA)
