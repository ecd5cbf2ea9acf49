"""The one pass over the logits that every loss shares.

`compute_logit_stats` reads a logits tensor (or a TP rank's vocab shard of it) once and returns a
`LogitStats`: per token the full-vocab log-sum-exp and the target logit (cross-entropy is their
difference), and at the M numeric positions the [M, N] numeric logits. Every loss term in
`numloss.losses` is written against `LogitStats` alone, so the same math runs on dense logits, on
vocab-parallel shards and on the chunked head (which builds a `LogitStats` from hidden states).

Memory and communication: one fused autograd function computes the row max, the sum of exponentials,
the target logit and the numeric columns, and in backward writes a single [T, V_local] gradient
(softmax scaled by the log-sum-exp's gradient, plus the target's and the numeric columns' gradients
added in place), so a numeric term adds no full-vocab tensor. With a TP group, forward issues one MAX
all-reduce, one packed SUM all-reduce of (sum-exp, target logit) and one all-gather of [M, width]
numeric columns; backward issues nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from .parallel import ShardLayout, all_reduce_, gather_numeric_columns, rank_in, world_size
from .runs import NumericRuns, numeric_runs
from .vocab import NumericVocab

IGNORE_INDEX = -100


@dataclass
class NumericRows:
    """The numeric positions of a batch: M rows whose label is a numeric token."""

    rows: torch.Tensor  # [M] flat token positions, increasing
    target: torch.Tensor  # [M] numeric-column index of each label
    logits: torch.Tensor  # [M, N] fp32 numeric logits, identical on every TP rank
    lse: torch.Tensor  # [M] fp32 full-vocab log-sum-exp at those rows

    @property
    def count(self) -> int:
        return self.rows.numel()


@dataclass
class LogitStats:
    """What the losses need from the logits of one batch (see module docstring).

    `lse` and `target_logit` are [T] fp32 over all flattened positions (0 target logit where ignored);
    `valid` marks labels that are not ignore_index; `shape` is the labels' shape, whose last dimension
    is the sequence (numeric runs never cross it).
    """

    labels: torch.Tensor  # [T]
    valid: torch.Tensor  # [T] bool
    lse: torch.Tensor  # [T]
    target_logit: torch.Tensor  # [T]
    numeric: NumericRows
    shape: torch.Size
    is_numeric: torch.Tensor  # [T] bool

    @property
    def valid_count(self) -> int:
        return int(self.valid.sum())

    @cached_property
    def ce_per_token(self) -> torch.Tensor:
        """[T] cross-entropy, exactly 0 at ignored positions."""
        return torch.where(self.valid, self.lse - self.target_logit, torch.zeros_like(self.lse))

    @cached_property
    def runs(self) -> NumericRuns:
        """Maximal runs of consecutive numeric labels within each sequence (NTIL, DIST2 place value)."""
        return numeric_runs(self.is_numeric.view(self.shape))


def validate_labels(labels: torch.Tensor, vocab_size: int, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The mask of valid labels; ValueError for any label outside [0, vocab_size) but ignore_index."""
    valid = labels != ignore_index
    bad = valid & ((labels < 0) | (labels >= vocab_size))
    if bad.any():
        where = bad.nonzero()[0].tolist()
        raise ValueError(
            f"{int(bad.sum())} label(s) outside [0, {vocab_size}) and not ignore_index={ignore_index};"
            f" e.g. {int(labels[tuple(where)])} at index {tuple(where)}"
        )
    return valid


def combine_across_ranks(row_max: torch.Tensor, sum_exp: torch.Tensor, target: torch.Tensor, group):
    """Global (lse, target logit) from each rank's local row max, sum of exp(x - row_max) and target
    logit (0 where not owned): one MAX all-reduce, one packed SUM all-reduce. No autograd."""
    global_max = all_reduce_(row_max.clone(), "max", group)
    packed = torch.stack([sum_exp * torch.exp(row_max - global_max), target])
    all_reduce_(packed, "sum", group)  # one collective for both sums
    return global_max + packed[0].log(), packed[1]


def local_row_stats(x: torch.Tensor, target_local: torch.Tensor, owns_target: torch.Tensor, in_place: bool = False):
    """Row max, sum of exp(x - max) and owned target logit of fp32 logits `x` [C, V_local].

    `in_place=True` overwrites `x` with exp(x - row max) instead of allocating a second [C, V_local]
    buffer: for a caller that owns `x` (the chunked head's chunk) and wants the exponentials next."""
    row_max = x.max(dim=-1).values
    target = x.gather(1, target_local[:, None]).squeeze(1)
    exps = x.sub_(row_max[:, None]) if in_place else x - row_max[:, None]
    sum_exp = exps.exp_().sum(dim=-1)
    return row_max, sum_exp, torch.where(owns_target, target, torch.zeros_like(target))


class _LogitStatsFn(torch.autograd.Function):
    """logits [T, V_local] -> (lse [T], target_logit [T], numeric columns [M, n_local]), fp32.

    Backward returns one fresh gradient tensor and issues no communication: the loss is the same on
    every TP rank, so each rank's gradient of its shard is its local softmax times d loss / d lse.
    """

    @staticmethod
    def forward(ctx, logits, target_local, owns_target, num_rows, num_cols, group):
        x = logits.float()  # no copy for fp32 input; the input is never written to
        lse, target = combine_across_ranks(*local_row_stats(x, target_local, owns_target), group)
        numeric = x[num_rows[:, None], num_cols[None, :]]
        ctx.save_for_backward(logits, lse, target_local, owns_target, num_rows, num_cols)
        return lse, target, numeric

    @staticmethod
    def backward(ctx, grad_lse, grad_target, grad_numeric):
        logits, lse, target_local, owns_target, num_rows, num_cols = ctx.saved_tensors
        grad = logits.float() - lse[:, None] if logits.dtype == torch.float32 else logits.float().sub_(lse[:, None])
        grad.exp_().mul_(grad_lse[:, None])
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad.index_put_((rows, target_local), torch.where(owns_target, grad_target, 0.0), accumulate=True)
        if num_rows.numel():
            grad.index_put_((num_rows[:, None], num_cols[None, :]), grad_numeric, accumulate=True)
        return grad.to(logits.dtype), None, None, None, None, None


@dataclass
class LabelPlan:
    """What a pass over the logits needs to know about the labels, before any logit is read."""

    labels: torch.Tensor  # [T]
    valid: torch.Tensor  # [T]
    column: torch.Tensor  # [T] numeric column of each label, -1 if none
    is_numeric: torch.Tensor  # [T]
    num_rows: torch.Tensor  # [M]
    owns_target: torch.Tensor  # [T] the label's token lies in this rank's shard
    target_local: torch.Tensor  # [T] its offset in the shard (0 where not owned)
    layout: ShardLayout
    shape: torch.Size

    def stats(self, lse, target_logit, numeric_local, group) -> LogitStats:
        """Assemble `LogitStats` from a pass's outputs, gathering the numeric columns across TP ranks."""
        numeric_logits = gather_numeric_columns(numeric_local, self.layout, group)
        return LogitStats(
            labels=self.labels,
            valid=self.valid,
            lse=lse,
            target_logit=target_logit,
            numeric=NumericRows(self.num_rows, self.column[self.num_rows], numeric_logits, lse[self.num_rows]),
            shape=self.shape,
            is_numeric=self.is_numeric,
        )


def plan_labels(
    labels: torch.Tensor,
    vocab: NumericVocab,
    vocab_local: int,
    device: torch.device,
    group=None,
    vocab_start: int = 0,
    ignore_index: int = IGNORE_INDEX,
    numeric: bool = True,
) -> LabelPlan:
    """Validate labels against the (global) vocab and locate targets and numeric columns in the shard."""
    tp = world_size(group)
    if tp == 1 and vocab_start != 0:
        raise ValueError(f"vocab_start={vocab_start} without a TP group: the logits must be the full vocabulary")
    vocab_size = vocab_local if tp == 1 else vocab.vocab_size
    if vocab_start < 0 or vocab_start + vocab_local > vocab_size:
        raise ValueError(f"local vocab range [{vocab_start}, {vocab_start + vocab_local}) exceeds vocab size {vocab_size}")
    if tp == 1 and int(vocab.token_ids.max()) >= vocab_local:
        raise ValueError(f"{vocab.name}: numeric token id {int(vocab.token_ids.max())} does not fit logits"
                         f" of width {vocab_local}")
    flat_labels = labels.reshape(-1).to(device)
    valid = validate_labels(flat_labels, vocab_size, ignore_index)

    # Numeric column of every label (-1 for non-numeric, ignored, or beyond the vocabulary's table).
    index_of = vocab.index_on(device)
    in_table = valid & (flat_labels < index_of.numel())
    column = torch.where(in_table, index_of[torch.where(in_table, flat_labels, 0)], -1)
    is_numeric = (column >= 0) if numeric else torch.zeros_like(valid)

    layout = vocab.memo(
        ("layout", id(group), tp, rank_in(group), vocab_start, vocab_local),
        lambda: ShardLayout.exchange(vocab.token_ids, vocab_start, vocab_local, group),
    )
    owns_target = valid & (flat_labels >= vocab_start) & (flat_labels < vocab_start + vocab_local)
    return LabelPlan(
        labels=flat_labels,
        valid=valid,
        column=column,
        is_numeric=is_numeric,
        num_rows=is_numeric.nonzero().flatten(),
        owns_target=owns_target,
        target_local=torch.where(owns_target, flat_labels - vocab_start, 0),
        layout=layout,
        shape=labels.shape,
    )


def compute_logit_stats(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab: NumericVocab,
    group=None,
    vocab_start: int = 0,
    ignore_index: int = IGNORE_INDEX,
    numeric: bool = True,
) -> LogitStats:
    """One pass over `logits` [..., V_local] with `labels` [...] (aligned; the caller shifts).

    Parallel contract: with `group` (TP ranks), `logits` is this rank's shard of the vocab range
    [vocab_start, vocab_start + V_local), `labels` are identical on every rank, and the global vocab
    size is `vocab.vocab_size`. The returned stats are identical on every rank (up to which rank's
    gradient flows into which shard). Without a group the logits are the full vocabulary.
    `numeric=False` skips the numeric columns (M = 0, no gather): what plain CE needs.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} do not align:"
                         " expected logits [..., V] with labels [...]")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    v_local = logits.shape[-1]
    plan = plan_labels(labels, vocab, v_local, logits.device, group, vocab_start, ignore_index, numeric)
    lse, target_logit, numeric_local = _LogitStatsFn.apply(
        logits.reshape(-1, v_local), plan.target_local, plan.owns_target, plan.num_rows,
        plan.layout.local_cols.to(logits.device), group,
    )
    return plan.stats(lse, target_logit, numeric_local, group)
