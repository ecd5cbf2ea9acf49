"""The loop's micro-batches -> what the Megatron engine's pipeline schedule feeds GPTModel. Local; no
communication.

In: dicts of `[b, s]` tensors `input_ids`, `labels` (Hugging Face style: unshifted, `ignore_index` where
not scored), `attention_mask` (1: a real token), optional `position_ids`, `sequence_ids` (packed rows'
segment ids, 0 on padding). Labels are shifted once, per row (logit-aligned); every micro-batch keeps
its own length: the schedule runs each at its own shape (with PP, `variable_seq_lengths` exchanges the
p2p shapes), so a step of short rows is not padded to its longest micro-batch.

Two forms, one per layer spec (`kernels.KernelPlan.packing`):
- "mask" (megatron's local spec; the CPU path): `[b, s']` with `s'` the micro-batch's last real column
  rounded up to `pad_multiple` (the engine's: `data.pad_to_multiple_of`, and TP when sequence parallel,
  since SP splits the sequence over TP ranks), and `attention_mask` in Megatron's form: None (Megatron's
  causal mask) when rows are right-padded and unpacked (padding then sits after every real token, and
  its labels are ignored), else a `[b, 1, s', s']` bool mask, True where attention is NOT allowed:
  causal, within a segment, never onto padding (a padded query attends to itself only, so no row is
  empty).
- "thd" (the Transformer Engine spec): the micro-batch's real tokens only, as one row `[1, T]`, every
  example (a row, or a packed row's segment) one sequence of megatron's `PackedSeqParams` (qkv_format
  "thd", `cu_seqlens` int32 `[n + 1]`, `max_seqlen`); TE's attention runs each sequence causally on its
  own (megatron turns the spec's causal mask type into TE's padding_causal for THD) and megatron's RoPE
  restarts at each sequence. Padding is dropped; when `pad_multiple` needs it, `pad` tokens are appended
  as one more sequence of their own (ignored labels, attending among themselves), so no kernel ever
  sees a position outside `cu_seqlens`. `sequence_ids` number the sequences, so NTIL still counts each
  example as one sequence. No attention mask: TE's causal attention would ignore one.

`tokens_run` (each prepared micro-batch's positions, padding included) is what the engine reports as
the positions it ran (`recipes.train` logs padding_ratio from it).
"""

from __future__ import annotations

import torch

from numloss import shift_labels

PACKINGS = ("mask", "thd")


def prepare_window(window: list[dict], pad_multiple: int = 1, ignore_index: int = -100,
                   packing: str = "mask", one_length: bool = False) -> list[dict]:
    """Each of the loop's micro-batches in the schedule's form `packing` (see the module docstring), each
    at its own length, or with `one_length` all padded to the longest of them (the interleaved schedule:
    megatron-core 0.16.1's p2p shape exchange sends both directions to the same peer over one group, and
    at PP 2 with interleaving the receiver got the other direction's shape on gloo)."""
    if packing not in PACKINGS:
        raise ValueError(f"packing {packing!r}: expected one of {list(PACKINGS)}")
    prepare = thd_micro_batch if packing == "thd" else mask_micro_batch
    batches = [prepare(m, pad_multiple, ignore_index) for m in window]
    longest = max(m["input_ids"].shape[1] for m in batches)
    if one_length and any(m["input_ids"].shape[1] != longest for m in batches):
        batches = [prepare(m, pad_multiple, ignore_index, length=longest) for m in window]
    return batches


def _real_tokens(m: dict) -> torch.Tensor:
    b, s = m["input_ids"].shape
    real = m.get("attention_mask")
    if real is None:
        return torch.ones(b, s, dtype=torch.bool, device=m["input_ids"].device)
    if real.dim() != 2:
        raise ValueError(f"the Megatron engine takes a [b, s] attention_mask (1: a real token) and sequence_ids"
                         f" for packed rows; got a {real.dim()}-D mask")
    return real.bool()


def mask_micro_batch(m: dict, pad_multiple: int = 1, ignore_index: int = -100, length: int = 0) -> dict:
    """One micro-batch in the "mask" form: cut after its last real column, right-padded to a multiple of
    `pad_multiple` (or to `length` when that is longer)."""
    device = m["input_ids"].device
    real = _real_tokens(m)
    labels = shift_labels(m["labels"], ignore_index)
    b, s = real.shape
    # the last column any row uses (a real token or a scored label): what lies after it is padding alone
    used = (real | (labels != ignore_index)).any(0).nonzero()
    longest = int(used.max()) + 1 if used.numel() else 1
    length = max(-(-longest // pad_multiple) * pad_multiple, length)
    keep = min(length, s)
    pad = length - keep

    def fit(x: torch.Tensor, value: int) -> torch.Tensor:
        return torch.nn.functional.pad(x[:, :keep], (0, pad), value=value)

    positions = m.get("position_ids")
    positions = torch.arange(s, device=device).expand(b, s) if positions is None else positions
    positions = positions[:, :keep]
    out = {"input_ids": fit(m["input_ids"], 0), "labels": fit(labels, ignore_index),
           "position_ids": torch.cat([positions, positions[:, -1:] + 1 + torch.arange(pad, device=device)], 1),
           "tokens_run": b * length}
    real = fit(real.long(), 0).bool()
    out["padding_mask"] = ~real  # MoE routers leave padding out of the load-balancing loss (moe.py)
    segments = m.get("sequence_ids")
    if segments is not None:
        out["sequence_ids"] = fit(segments, 0)
    if segments is None and bool((real[:, 1:] <= real[:, :-1]).all()):  # unpacked, right-padded
        out["attention_mask"] = None
        return out
    allowed = torch.ones(length, length, dtype=torch.bool, device=device).tril() & real[:, None, :]
    if segments is not None:
        allowed &= out["sequence_ids"][:, :, None] == out["sequence_ids"][:, None, :]
    allowed |= torch.eye(length, dtype=torch.bool, device=device)
    out["attention_mask"] = ~allowed[:, None]
    return out


def thd_micro_batch(m: dict, pad_multiple: int = 1, ignore_index: int = -100, length: int = 0) -> dict:
    """One micro-batch in the "thd" form: its real tokens as `[1, T]` sequences with `packed_seq_params`
    (T a multiple of `pad_multiple`, or `length` when that is longer)."""
    device = m["input_ids"].device
    real = _real_tokens(m)
    b, s = real.shape
    segments = m.get("sequence_ids")
    segments = real.long() if segments is None else segments.long()
    if bool((real & (segments <= 0)).any()) or bool((~real & (segments > 0)).any()):
        row = int(((real & (segments <= 0)) | (~real & (segments > 0))).any(1).nonzero()[0])
        raise ValueError(f"micro-batch row {row}: sequence_ids and attention_mask disagree (a real token needs a "
                         f"segment id > 0, padding 0)")
    labels = shift_labels(m["labels"], ignore_index)  # per row: no label crosses a row
    keep = real.reshape(-1)
    rows = torch.arange(b, device=device).repeat_interleave(s)[keep]
    key = rows * (int(segments.max()) + 1) + segments.reshape(-1)[keep]  # one key per (row, segment)
    total = int(keep.sum())
    if total == 0:
        raise ValueError("a micro-batch without a real token (attention_mask all 0)")
    starts = torch.ones(total, dtype=torch.bool, device=device)
    starts[1:] = key[1:] != key[:-1]
    if int(starts.sum()) != key.unique().numel():
        raise ValueError("a packed row's segment is not contiguous (its sequence_ids come back after another "
                         "segment's): THD needs each example in one piece")
    bounds = torch.cat([starts.nonzero().view(-1), torch.tensor([total], device=device)])
    lengths = bounds.diff()
    pad = max(-total % pad_multiple, length - total)
    if pad:
        lengths = torch.cat([lengths, torch.tensor([pad], device=device)])
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), lengths.cumsum(0)]).to(torch.int32)
    sequence = torch.arange(1, len(lengths) + 1, device=device).repeat_interleave(lengths)
    if pad:
        sequence[total:] = 0  # the padding sequence holds no label: counted as no example
    positions = torch.arange(total + pad, device=device) - cu_seqlens[:-1].long().repeat_interleave(lengths)

    def flat(x: torch.Tensor, value: int) -> torch.Tensor:
        return torch.nn.functional.pad(x.reshape(-1)[keep], (0, pad), value=value)[None]

    padding = torch.zeros(1, total + pad, dtype=torch.bool, device=device)
    padding[:, total:] = True  # MoE routers leave it out of the load-balancing loss (moe.py)
    return {"input_ids": flat(m["input_ids"], 0), "labels": flat(labels, ignore_index), "padding_mask": padding,
            "position_ids": positions[None], "sequence_ids": sequence[None], "attention_mask": None,
            "packed_seq_params": thd_params(cu_seqlens, int(lengths.max())), "tokens_run": total + pad}


def thd_params(cu_seqlens: torch.Tensor, max_seqlen: int):
    """megatron's `PackedSeqParams` for THD sequences bounded by `cu_seqlens` (int32, `[n + 1]`, from 0 to
    the row's length): queries and keys share them; no per-sequence padding (`cu_seqlens_*_padded` unset:
    each sequence is its real tokens; context parallelism, which would pad each to 2 x CP, is refused)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)


def check_attention(micro_batch: dict, te: bool, packing: str) -> None:
    """Refuse a prepared micro-batch whose attention inputs the model would not honour, before the schedule
    runs: under the Transformer Engine spec (causal mask type) TE ignores a dense mask, so packed rows
    would attend across examples without a word; a "mask" model's attention takes no THD sequences, and a
    "thd" one (TE's) needs them."""
    if te and micro_batch.get("attention_mask") is not None:
        raise ValueError("a dense attention mask for the Transformer Engine layer spec: TE's causal attention "
                         "ignores it (packed examples would attend to each other); packed rows must go as THD "
                         "(packing 'thd')")
    thd = micro_batch.get("packed_seq_params") is not None
    if thd != (packing == "thd"):
        raise ValueError(f"a micro-batch {'with' if thd else 'without'} THD sequences (packed_seq_params) for a "
                         f"model whose attention takes packing {packing!r}")
