"""A reader batch -> the keyword arguments of `NumericCausalLM`: the model's inputs and the labels.

- Unpacked text rows: `input_ids`, `labels`, `attention_mask` [B, T] as the reader made them.
- Packed text rows (data_prep `--pack-length`: several examples per row): the examples must not see
  each other. Positions restart at 0 for every example (the reader's `position_ids`) and attention is
  block-diagonal by segment, each block causal:
  - sdpa: a boolean [B, 1, T, T] mask (True: may attend);
  - eager: the same as an additive mask in the model's dtype (0 or the dtype's minimum);
  - flash-attention: no mask can be passed, so the batch is flattened to one row [1, B*T] with the
    position ids alone; transformers then runs variable-length attention, one sequence per restart
    of the positions (its DataCollatorWithFlattening convention), with the sequences' boundaries
    precomputed (`cu_seq_lens_q/k`, `max_length_q/k`: `flash_varlen_kwargs`). Exact: every row starts at
    position 0, and data_prep gives the first token of each example label -100, so no loss crosses
    an example or a row.
  Padding (segment 0) attends to itself only, so its softmax row stays finite; its labels are -100.
- Image rows: `recipes.inputs.vision.training_inputs` (image tokens expanded by the processor, pixel tensors).
- `attn_implementation="segments"`: a model that builds its own attention mask from `[B, T]` tensors
  (the Megatron engine) gets the rows as the reader made them, packed rows with their `position_ids`
  and `sequence_ids` (the segment ids) and no 4-D mask.

`model_inputs` also returns the number of real tokens in the batch (for tokens per second).

Packed rows also give the wrapper `sequence_ids` (the segment ids; made unique across rows when the
batch is flattened for flash-attention): NTIL averages over sequences, and with them each packed
example counts as one sequence, as it would unpacked. Every other term is a mean over tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from .vision import training_inputs


def packed_attention_mask(segment_ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[B, 1, T, T] attention mask of packed rows from `segment_ids` [B, T] (1, 2, ... per example,
    0 on padding): causal within each segment, nothing across. Boolean (True: may attend), or
    additive in `dtype` (0 where allowed, the dtype's minimum elsewhere)."""
    t = segment_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=segment_ids.device).tril()
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    allowed = same & causal & (segment_ids[:, None, :] > 0)
    allowed |= torch.eye(t, dtype=torch.bool, device=segment_ids.device)  # padding: itself only
    allowed = allowed[:, None]
    if dtype is None:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=segment_ids.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)


def flash_varlen_kwargs(position_ids: torch.Tensor) -> dict[str, Any]:
    """transformers' flash-attention keyword arguments for the flattened packed row, computed here (on the
    host, before the batch moves to the GPU) as transformers would from the positions
    (`prepare_fa_kwargs_from_position_ids`: a sequence starts at every position 0), so it does not derive
    them again in every layer, each time with a device synchronisation (`max_length` as a Python int)."""
    flat = position_ids.reshape(-1)
    cu = torch.cat([(flat == flat.min()).nonzero().view(-1), torch.tensor([flat.numel()], device=flat.device)])
    cu = cu.to(torch.int32)
    longest = int(cu.diff().max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def model_inputs(batch: dict[str, Any], *, processor=None, attn_implementation: str = "sdpa",
                 dtype: torch.dtype = torch.float32, pad_to_multiple_of: int = 1,
                 max_length: int | None = None) -> tuple[dict[str, Any], int]:
    """(keyword arguments for the wrapper, real tokens in the batch) on the batch's device; see the
    module docstring. `attn_implementation` is the model's (`model.config._attn_implementation`)."""
    if processor is not None:
        inputs = training_inputs(processor, batch, pad_to_multiple_of=pad_to_multiple_of, max_length=max_length)
        inputs = {k: v.to(dtype) if torch.is_tensor(v) and torch.is_floating_point(v) else v
                  for k, v in inputs.items()}
        return inputs, int(inputs["attention_mask"].sum())
    tokens = int(batch["attention_mask"].sum())
    if "segment_ids" not in batch:
        return {k: batch[k] for k in ("input_ids", "labels", "attention_mask")}, tokens
    if attn_implementation == "segments":
        return {"input_ids": batch["input_ids"], "labels": batch["labels"], "attention_mask": batch["attention_mask"],
                "position_ids": batch["position_ids"], "sequence_ids": batch["segment_ids"]}, tokens
    if attn_implementation.startswith("flash_attention"):
        segments = batch["segment_ids"]
        rows = torch.arange(segments.shape[0], device=segments.device)[:, None] * (int(segments.max()) + 1)
        return {"input_ids": batch["input_ids"].reshape(1, -1), "labels": batch["labels"].reshape(1, -1),
                "position_ids": batch["position_ids"].reshape(1, -1), "attention_mask": None,
                "sequence_ids": (segments + rows).reshape(1, -1),
                **flash_varlen_kwargs(batch["position_ids"])}, tokens
    if attn_implementation not in ("sdpa", "eager"):
        raise ValueError(f"packed shards need attention that takes a 4-D mask (sdpa, eager) or "
                         f"flash-attention; the model uses {attn_implementation!r}")
    mask = packed_attention_mask(batch["segment_ids"], None if attn_implementation == "sdpa" else dtype)
    return {"input_ids": batch["input_ids"], "labels": batch["labels"], "position_ids": batch["position_ids"],
            "attention_mask": mask, "sequence_ids": batch["segment_ids"]}, tokens
