"""numloss on megatron-core: the last pipeline stage's `loss_func` for its schedules, normalised over the
whole optimizer step (`numeric_loss_func`), what `recipes.engines.megatron` trains with and what a
training loop of one's own passes to megatron-core's schedules.

What megatron-core (0.16) does, read from its source:

- `GPTModel.forward(input_ids, position_ids, attention_mask)` without labels
  (`megatron/core/models/gpt/gpt_model.py`) runs the output layer (`ColumnParallelLinear` with
  `gather_output=not parallel_output`), so with `parallel_output=True` it returns the logits
  `[b, s, V/tp]`: the padded vocab split evenly, rank r holding `[r·V/tp, (r+1)·V/tp)`. With labels it
  would return per-token CE from `tensor_parallel.vocab_parallel_cross_entropy`, which has no ignore
  index (Megatron's labels carry real token ids where `loss_mask` is 0) and overwrites fp32 input.
- The forward_step_func returns the output and a `loss_func`; the schedules call `loss_func(output)`
  and, with `calculate_per_token_loss=True`, backpropagate its first value as it is, sum its token
  counts over micro-batches and data-parallel ranks into `T`, and `finalize_model_grads` divides every
  gradient by `T`.

Step-global form (`numeric_loss_func`): every term is divided by the optimizer step's global
`LossCounts` (`numloss.normalization`: counted from the labels of every micro-batch on every
data-parallel rank, one SUM all-reduce over the data-parallel group before the first micro-batch), so
each micro-batch's value is its share of the global batch's loss, exactly as `recipes/training/parallel.py`
does for DeepSpeed. Megatron's own normalisation is then undone, not bypassed: with
`calculate_per_token_loss` the schedules neither divide by the micro-batch count nor DDP by the
data-parallel size (gradients are summed), and `finalize_model_grads` divides by `T`. The loss_func
therefore returns `share x T` with this micro-batch's token count: the gradient that reaches the
optimizer is that of the global batch's loss, the same on every layout and on both engines, and a
model trained through Megatron's stock `finalize_model_grads` needs nothing else.

Labels: the training loop gives Hugging Face-style unshifted labels with -100; `numloss.shift_labels`
(the one the HF adapter and the trainer integration use) is the one place they are shifted to be
logit-aligned. `megatron_labels` turns shifted labels into Megatron's (labels without an ignore index,
loss_mask) for Megatron's own CE. Not supported: context parallelism (each CP rank would average its own
sequence chunk).

Importing this module does not import megatron: `parallel_state` is read at call time.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..normalization import LossCounts
from ..objective import Objective

__all__ = ["megatron_labels", "megatron_tp_group", "numeric_loss_func"]


def megatron_tp_group(model=None):
    """The tensor-parallel group: `model.pg_collection.tp` if the model has one, else megatron-core's
    `parallel_state.get_tensor_model_parallel_group()`; None when megatron's model parallel state is
    not initialised."""
    pg = getattr(getattr(model, "pg_collection", None), "tp", None)
    if pg is not None:
        return pg
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tensor_model_parallel_group()


def _tp_layout(group, v_local: int, vocab_size: int) -> tuple[object, int]:
    """(group or None at TP 1, this rank's vocab start) for Megatron's even split of the padded vocab."""
    if group == "megatron":
        group = megatron_tp_group()
    if group is not None and dist.get_world_size(group) == 1:
        group = None
    tp = 1 if group is None else dist.get_world_size(group)
    if tp > 1 and v_local * tp != vocab_size:
        raise ValueError(f"logits shards of {v_local} columns x TP {tp} = {v_local * tp} differ from the numeric"
                         f" vocabulary's size {vocab_size}: build it with the model's padded vocab size")
    return group, 0 if group is None else dist.get_rank(group) * v_local


def megatron_labels(labels: torch.Tensor, ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Shifted (logit-aligned) labels with `ignore_index` -> Megatron's (labels, loss_mask) `[b, s]`.

    Megatron's labels have no ignore index: an ignored position gets token 0 and loss_mask 0 (float).
    Purely local; no communication."""
    keep = labels != ignore_index
    return torch.where(keep, labels, torch.zeros_like(labels)), keep.to(torch.float32)


def numeric_loss_func(
    objective: Objective,
    counts: LossCounts,
    labels: torch.Tensor,
    logits: torch.Tensor,
    *,
    sequence_ids: torch.Tensor | None = None,
    group="megatron",
    real_vocab_size: int | None = None,
    diagnostics: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """The last pipeline stage's `loss_func` with step-global counts (see the module docstring).

    Bind everything but the logits: `functools.partial(numeric_loss_func, objective, counts, labels,
    sequence_ids=...)`, and return it from the forward_step_func with the model's output.

    - `counts`: the step's counts, `reduce_counts([objective.counts(l, ids) for l, ids in window],
      group=dp_group)`: identical on every rank of the step (every TP, PP and DP rank).
    - `labels [b, s]`: this micro-batch's shifted labels (`shift_labels`), `ignore_index` where not
      scored; identical on the TP ranks. `sequence_ids [b, s]` (optional): packed rows' segment ids.
    - `logits [b, s, V/tp]`: as GPTModel returns them without labels (`parallel_output=True`); the TP
      group is megatron-core's (`group="megatron"`) or the one given (None: full logits). The numeric
      vocabulary must have the model's padded vocab size.
    - `real_vocab_size`: the vocabulary before Megatron's padding (the HF model's logits width). The
      padded columns (zero weight rows: logit 0) would otherwise enter every softmax, so the loss
      would differ from the HF model's and between TP sizes that pad differently; they are set to
      the dtype's lowest value IN PLACE in `logits` (GPTModel's logits without labels are a fresh tensor nobody else
      reads; autograd gives those columns a zero gradient). None: every column counts.

    Returns `(share x T, n, report)`: `T` the step's global token count, `n` this micro-batch's valid
    tokens (int tensor; Megatron sums them over micro-batches and the DP group into `T` and divides
    the gradients by it), and `report` this micro-batch's share of the logged values (the keys of
    `ObjectiveOutput.log_dict()`; summed over micro-batches and DP ranks they are the global batch's;
    with `diagnostics` also the gradient sums `grad_sums/*` of `numloss.diagnostics`, which add the same way).
    Collectives: the objective's two over the TP group (every TP rank gets the same value); nothing
    over DP or PP. Requires `calculate_per_token_loss=True`, context parallel size 1, and DDP without
    `average_in_collective` (megatron-core asserts the latter itself).
    """
    if logits.dim() != 3 or logits.shape[:2] != labels.shape:
        raise ValueError(f"expected logits [b, s, V/tp] and labels [b, s], got {tuple(logits.shape)} and"
                         f" {tuple(labels.shape)}")
    group, vocab_start = _tp_layout(group, logits.shape[-1], objective.vocab.vocab_size)
    if real_vocab_size is not None and real_vocab_size < vocab_start + logits.shape[-1]:
        # The dtype's lowest value, not -inf: a shard of padding only would have a row max of -inf and
        # its local sum of exponentials would turn NaN (exp(-inf - -inf)).
        logits[..., max(real_vocab_size - vocab_start, 0):] = torch.finfo(logits.dtype).min
    out = objective(logits, labels, group, vocab_start, counts=counts, sequence_ids=sequence_ids,
                    diagnostics=diagnostics)
    tokens = counts.denominator(objective.denominator_keys()["ce"])
    n_local = (labels != objective.config.ignore_index).sum().to(device=logits.device, dtype=torch.int)
    return out.loss * tokens, n_local, out.log_dict()
