"""numloss on megatron-core: the step-global `loss_func` of the pipeline schedules, and a
per-micro-batch replacement for `GPTModel.compute_language_model_loss`.

What megatron-core (0.16) does, read from its source:

- `GPTModel.forward(input_ids, position_ids, attention_mask, labels=..., loss_mask=...)`
  (`megatron/core/models/gpt/gpt_model.py`) runs the output layer (`ColumnParallelLinear` with
  `gather_output=not parallel_output`), so with `parallel_output=True` the logits are `[s, b, V/tp]`
  (the padded vocab split evenly: rank r holds `[r·V/tp, (r+1)·V/tp)`), then returns
  `self.compute_language_model_loss(labels, logits)`: per-token losses `[b, s]`
  (`LanguageModule.compute_language_model_loss`, `models/common/language_module/language_module.py`,
  which calls `tensor_parallel.vocab_parallel_cross_entropy`). The training loop's `loss_func` then
  reduces them as `sum(losses * loss_mask) / sum(loss_mask)` (or sums the masked losses and divides by
  the token count of the whole global batch with `calculate_per_token_loss`).
- `compute_language_model_loss` never sees `loss_mask`, and Megatron labels have no ignore index
  (masked positions carry real token ids). `forward` does receive `loss_mask` (it is passed on for
  multi-token prediction).

The design here (per-token form of a mean objective):

    per_token[b, s] = ce[b, s] + (total - mean_valid(ce))     at valid positions, 0 elsewhere

where `ce` is the per-token cross-entropy, `total` the objective's scalar (CE + Σ w_k·term_k, GCE
mixing, z-loss), and "valid" means `loss_mask == 1`. Then Megatron's masked mean
`Σ_valid per_token / n_valid` equals `total` exactly in value and gradient (the numeric terms are
spread evenly over the valid tokens of the micro-batch; each term is still computed once, as the
mean over this micro-batch's numeric positions). With `calculate_per_token_loss` (sums over
micro-batches and data-parallel ranks divided by the global token count) the CE part is the exact
global token mean and each micro-batch's numeric terms weigh by its share of the valid tokens.

`install_numeric_loss(model, objective)` patches one GPTModel instance: `forward` records the
`loss_mask` it is given, and `compute_language_model_loss` uses it (positions with `loss_mask == 0`
become `ignore_index` for the objective, so the numeric terms never see padding or prompts). Call
`model(..., labels=labels, loss_mask=loss_mask)`; without a `loss_mask` every position is valid
(as in Megatron's own CE). Labels equal to the objective's `ignore_index` are ignored as well.

Layout: the logits stay `[s, b, V/tp]` (no transpose copy of the logits); the objective's one pass
runs in that order and its per-token statistics (vectors of T floats) are re-laid out to `[b, s]` so
that numbers run along the sequence (NTIL, DIST2's place value). Not supported: multi-token
prediction (`mtp_num_layers`; its loss call gets a rolled mask this hook cannot see) and context
parallelism for the numeric terms (each CP rank would average its own sequence chunk).

Step-global form (`numeric_loss_func`, what `recipes.engines.megatron` trains with): the last
pipeline stage's `loss_func` for megatron-core's schedules with `calculate_per_token_loss=True`.
Every term is divided by the optimizer step's global `LossCounts` (`numloss.normalization`: counted
from the labels of every micro-batch on every data-parallel rank, one SUM all-reduce over the
data-parallel group before the first micro-batch), so each micro-batch's value is its share of the
global batch's loss, exactly as `recipes/training/parallel.py` does for DeepSpeed. Megatron's own normalisation is
then undone, not bypassed: with `calculate_per_token_loss` the schedules neither divide by the
micro-batch count nor DDP by the data-parallel size (gradients are summed), and
`finalize_model_grads` divides every gradient by the global token count `T` (the sum, over
micro-batches and data-parallel ranks, of the token counts the loss_func returns). The loss_func
therefore returns `share x T` with this micro-batch's token count: the gradient that reaches the
optimizer is that of the global batch's loss, the same on every layout and on both engines, and a
model trained through Megatron's stock `finalize_model_grads` needs nothing else.

Labels: the training loop gives Hugging Face-style unshifted labels with -100; `numloss.shift_labels`
(the one the HF adapter and the trainer integration use) is the one place they are shifted to be
logit-aligned.
`megatron_labels` turns shifted labels into Megatron's (labels without an ignore index, loss_mask)
for `install_numeric_loss` and Megatron's own CE.

Importing this module does not import megatron: `parallel_state` is read at call time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..logit_stats import LogitStats, NumericRows, compute_logit_stats
from ..normalization import LossCounts
from ..objective import Objective, ObjectiveOutput

__all__ = ["PerTokenLoss", "install_numeric_loss", "language_model_loss", "megatron_labels",
           "megatron_tp_group", "numeric_loss_func"]


@dataclass
class PerTokenLoss:
    per_token: torch.Tensor  # [b, s]: masked mean over loss_mask == the objective's total
    ce_per_token: torch.Tensor  # [b, s] cross-entropy (0 where masked)
    valid: torch.Tensor  # [b, s] bool: the positions the objective counted
    output: ObjectiveOutput  # the objective's scalar total, CE and terms (for logging)


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


def _to_batch_major(stats: LogitStats, s: int, b: int) -> LogitStats:
    """`stats` computed on `[s, b]`-ordered positions, re-laid out as `[b, s]` (sequence last).

    Only the [T] vectors and the M numeric rows move (the logits are never copied); every tensor is
    permuted with differentiable indexing, so gradients flow back to the same logits."""

    def flip(x: torch.Tensor) -> torch.Tensor:
        return x.view(s, b).t().reshape(-1)

    num = stats.numeric
    new_rows = (num.rows % b) * s + torch.div(num.rows, b, rounding_mode="floor")
    order = new_rows.argsort()
    numeric = NumericRows(rows=new_rows[order], target=num.target[order], logits=num.logits[order], lse=num.lse[order])
    return LogitStats(labels=flip(stats.labels), valid=flip(stats.valid), lse=flip(stats.lse),
                      target_logit=flip(stats.target_logit), numeric=numeric, shape=torch.Size((b, s)),
                      is_numeric=flip(stats.is_numeric))


def language_model_loss(
    objective: Objective,
    labels: torch.Tensor,
    logits: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    group="megatron",
) -> PerTokenLoss:
    """Per-token losses `[b, s]` for Megatron from `labels [b, s]` and `logits [s, b, V_local]`.

    `group`: the TP group ("megatron": megatron-core's, see `megatron_tp_group`; None: full logits).
    This rank's vocab range is `[rank·V_local, (rank+1)·V_local)` (Megatron's even split of the padded
    vocabulary; `objective.vocab.vocab_size` must be that padded size). `loss_mask [b, s]` (0/1) marks
    the positions Megatron will average over; they are the objective's valid positions.
    """
    if logits.dim() != 3 or labels.dim() != 2 or logits.shape[:2] != labels.t().shape:
        raise ValueError(f"expected logits [s, b, V/tp] and labels [b, s], got {tuple(logits.shape)} and"
                         f" {tuple(labels.shape)}")
    s, b, v_local = logits.shape
    group, vocab_start = _tp_layout(group, v_local, objective.vocab.vocab_size)

    ignore = objective.config.ignore_index
    if loss_mask is not None:
        if loss_mask.shape != labels.shape:
            raise ValueError(f"loss_mask {tuple(loss_mask.shape)} must match labels {tuple(labels.shape)}")
        if not ((loss_mask == 0) | (loss_mask == 1)).all():
            raise ValueError("loss_mask must be 0/1: a weighted mask has no per-token form of the numeric terms")
        labels = torch.where(loss_mask.to(labels.device).bool(), labels, ignore)

    # One pass over the logits in their own [s, b] order (a free view), then sequence-last statistics.
    stats = compute_logit_stats(logits, labels.t(), objective.vocab, group, vocab_start, ignore,
                                numeric=bool(objective.config.terms))
    stats = _to_batch_major(stats, s, b)
    out = objective.from_stats(stats)

    ce = stats.ce_per_token  # [T], b-major, 0 where ignored
    valid = stats.valid
    n_valid = valid.sum()
    if int(n_valid) == 0:
        per_token = ce * 0 + out.loss * 0  # exactly 0, still attached to the graph
    else:
        extra = out.loss - ce.sum() / n_valid  # the numeric terms (and z-loss, GCE mixing), spread evenly
        per_token = torch.where(valid, ce + extra, torch.zeros_like(ce))
    return PerTokenLoss(per_token=per_token.view(b, s), ce_per_token=ce.view(b, s), valid=valid.view(b, s), output=out)


class _Hook:
    """What `install_numeric_loss` attaches to a model: the objective, the loss_mask of the forward in
    flight, and the last `PerTokenLoss` (for logging: `model.numloss.last.output.log_dict()`)."""

    def __init__(self, objective: Objective):
        self.objective = objective
        self.loss_mask: torch.Tensor | None = None
        self.last: PerTokenLoss | None = None


def install_numeric_loss(model, objective: Objective) -> _Hook:
    """Patch a megatron-core `GPTModel` instance so its loss is the numloss objective (see module doc).

    Returns the hook (also at `model.numloss`); the original methods stay reachable on the class."""
    if getattr(getattr(model, "config", None), "mtp_num_layers", None):
        raise NotImplementedError("numloss's Megatron adapter does not support multi-token prediction (mtp_num_layers)")
    if getattr(model, "numloss", None) is not None:
        raise ValueError("numloss is already installed on this model")
    hook = _Hook(objective)
    original_forward = model.forward

    def forward(*args, loss_mask=None, **kwargs):
        hook.loss_mask = loss_mask
        try:
            return original_forward(*args, loss_mask=loss_mask, **kwargs)
        finally:
            hook.loss_mask = None

    def compute_language_model_loss(labels, logits):
        result = language_model_loss(hook.objective, labels, logits, hook.loss_mask, group=megatron_tp_group(model))
        hook.last = result
        return result.per_token

    model.forward = forward
    model.compute_language_model_loss = compute_language_model_loss
    model.numloss = hook
    return hook
