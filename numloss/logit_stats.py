"""The one pass over the logits that every loss shares.

`compute_logit_stats` reads a logits tensor (or a TP rank's vocab shard of it) once and returns a
`LogitStats`: per token the full-vocab log-sum-exp and the target logit (cross-entropy is their
difference), and at the M numeric positions the [M, N] numeric logits. Every loss term in
`numloss.losses` is written against `LogitStats` alone, so the same math runs on dense logits, on
vocab-parallel shards and on the chunked head (which builds a `LogitStats` from hidden states).

Memory and communication: one fused autograd function computes the row max, the sum of exponentials,
the target logit and the numeric columns, and in backward writes a single [T, V_local] gradient
(softmax scaled by the log-sum-exp's gradient, plus the target's and the numeric columns' gradients
added in place), so a numeric term adds no full-vocab tensor. With a TP group, forward issues two
collectives and the numeric columns ride in one of them (`numloss.parallel`, "how the numeric columns
reach every rank"); backward issues nothing.

`numeric_logit_stats` is the other pass: for a term that reads only the [M, N] numeric slice
(renormalised over the numeric tokens), it reads just those M x N logits and adds its gradient into the
one arriving from the caller's cross-entropy, so such a term costs next to nothing beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from . import fused_pass
from .parallel import (
    ShardLayout,
    all_gather,
    all_reduce_,
    choose_route,
    columns_from_gather,
    exchange_numeric_columns,
    pad_owned_columns,
    rank_in,
    scatter_owned_columns,
    world_size,
)
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
    # rows split along the sequence over ranks: the whole rows' label structure
    # (`numloss.sequence_split.SplitView`); None when this rank holds whole rows
    split: object = None

    @property
    def valid_count(self) -> int:
        return int(self.valid.sum())

    @cached_property
    def ce_per_token(self) -> torch.Tensor:
        """[T] cross-entropy, exactly 0 at ignored positions."""
        return torch.where(self.valid, self.lse - self.target_logit, torch.zeros_like(self.lse))

    @cached_property
    def runs(self) -> NumericRuns:
        """Maximal runs of consecutive numeric labels within each sequence (NTIL, DIST2 place value). Under
        a sequence split: this rank's numeric positions with their places in the whole rows' runs."""
        if self.split is not None:
            return self.split.local_runs(self.numeric.rows)
        return numeric_runs(self.is_numeric.view(self.shape))


class _NeedsFullPass:
    """A field that numeric-only stats do not have: reading it is an error that says why."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        raise RuntimeError(
            f"{type(obj).__name__}.{self.name}: these stats hold only the numeric columns (no full-vocabulary"
            " log-sum-exp was computed); a term that needs it must use compute_logit_stats"
        )

    def __set__(self, obj, value):
        if value is not None:
            raise AttributeError(f"{type(obj).__name__}.{self.name} is not available on numeric-only stats")


class NumericOnlyRows(NumericRows):
    """`NumericRows` without the full-vocabulary log-sum-exp (see `numeric_logit_stats`)."""

    lse = _NeedsFullPass()


class NumericOnlyStats(LogitStats):
    """`LogitStats` from the numeric columns alone (see `numeric_logit_stats`)."""

    lse = _NeedsFullPass()
    target_logit = _NeedsFullPass()


def numeric_column(labels: torch.Tensor, valid: torch.Tensor, vocab: NumericVocab) -> torch.Tensor:
    """The numeric column (index into V_num) of every label; -1 where the label is not numeric, is
    ignored (`valid` False), or lies beyond the vocabulary's table."""
    index_of = vocab.index_on(labels.device)
    in_table = valid & (labels >= 0) & (labels < index_of.numel())
    return torch.where(in_table, index_of[torch.where(in_table, labels, 0)], -1)


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


def combine_across_ranks(row_max, sum_exp, target, owns_target, valid, numeric_owned, layout: ShardLayout, group):
    """Global (lse [C], target logit [C], numeric logits [m, N]) from this rank's row max, sum of
    exp(x - row max), owned target logit (0 where not owned) and owned numeric columns [m, n_local].

    With a TP group: two collectives, by the cheaper route of `numloss.parallel.choose_route`
    ("sum": MAX of the row max, then one SUM of (scaled sum-exp, target, zero-padded [m, N] block);
    "gather": MAX of the owned target logit, then one all-gather of (local lse, [m, width] columns)).
    Values are identical on every rank. No autograd."""
    if world_size(group) == 1:
        return row_max + sum_exp.log(), target, numeric_owned
    tokens, rows, columns = row_max.numel(), numeric_owned.shape[0], layout.columns
    if choose_route(tokens, rows, layout) == "sum":
        global_max = all_reduce_(row_max.clone(), "max", group)
        packed = row_max.new_zeros(2 * tokens + rows * columns)
        torch.mul(sum_exp, torch.exp(row_max - global_max), out=packed[:tokens])
        packed[tokens:2 * tokens] = target
        scatter_owned_columns(numeric_owned, layout, out=packed[2 * tokens:].view(rows, columns))
        all_reduce_(packed, "sum", group)  # one collective for the sums and the numeric block
        return global_max + packed[:tokens].log(), packed[tokens:2 * tokens], packed[2 * tokens:].view(rows, columns)
    # "gather": the target's owner is the only finite entry, so a MAX delivers it
    owner_target = all_reduce_(torch.where(owns_target, target, float("-inf")), "max", group)
    payload = row_max.new_zeros(tokens + rows * layout.width)
    torch.add(row_max, sum_exp.log(), out=payload[:tokens])
    pad_owned_columns(numeric_owned, layout, out=payload[tokens:].view(rows, layout.width))
    gathered = all_gather(payload, group)  # [world, T + M·width]
    lse = torch.logsumexp(gathered[:, :tokens], dim=0)
    numeric = columns_from_gather(gathered[:, tokens:].reshape(layout.world, rows, layout.width), layout)
    return lse, torch.where(valid, owner_target, 0.0), numeric


def local_row_stats(x: torch.Tensor, target_local: torch.Tensor, owns_target: torch.Tensor):
    """Row max, sum of exp(x - max) and owned target logit of fp32 logits `x` [C, V_local] (not written to)."""
    row_max = torch.amax(x, dim=-1)  # not max(dim): that also computes the argmax (~7x slower on CPU)
    target = x.gather(1, target_local[:, None]).squeeze(1)
    sum_exp = (x - row_max[:, None]).exp_().sum(dim=-1)
    return row_max, sum_exp, torch.where(owns_target, target, torch.zeros_like(target))


def own_columns_gradient(grad_numeric: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """[M, n_local]: the gradient of the columns this rank owns. Every TP rank computes the same loss from
    the same [M, N] block, so each keeps its own columns' gradient (a split, not a reduce)."""
    return grad_numeric if layout.world == 1 else grad_numeric[:, layout.owned.to(grad_numeric.device)]


class _LogitStatsFn(torch.autograd.Function):
    """logits [T, V_local] -> (lse [T], target_logit [T], numeric logits [M, N]), fp32, the same on every
    TP rank.

    Backward returns one gradient tensor and issues no communication: the loss is the same on every TP
    rank, so each rank's gradient of its shard is its local softmax times d loss / d lse, plus its own
    target and numeric columns. `fused`: the row statistics and the gradient come from the Triton kernels
    of `numloss.fused_pass` (same values; no fp32 [T, V] buffer). `in_place` (fused only): the gradient is
    written into the logits' own storage, whose version counter is then bumped, so any other autograd use
    of those logits after this backward fails loudly instead of reading a gradient as logits.
    """

    @staticmethod
    def forward(ctx, logits, target_local, owns_target, valid, num_rows, num_cols, layout, group, fused, in_place):
        if fused:
            row_stats = fused_pass.row_stats(logits, target_local, owns_target)
            numeric_owned = logits[num_rows[:, None], num_cols[None, :]].float()
        else:
            x = logits.float()  # no copy for fp32 input; the input is never written to
            numeric_owned = x[num_rows[:, None], num_cols[None, :]]
            row_stats = local_row_stats(x, target_local, owns_target)
        lse, target, numeric = combine_across_ranks(*row_stats, owns_target, valid, numeric_owned, layout, group)
        ctx.layout, ctx.fused, ctx.in_place = layout, fused, in_place
        ctx.save_for_backward(logits, lse, target_local, owns_target, num_rows, num_cols)
        return lse, target, numeric

    @staticmethod
    def backward(ctx, grad_lse, grad_target, grad_numeric):
        logits, lse, target_local, owns_target, num_rows, num_cols = ctx.saved_tensors
        if ctx.fused:
            in_place = ctx.in_place and logits.stride(1) == 1  # else the kernel reads a contiguous copy
            out = logits if in_place else None
            grad = fused_pass.write_gradient(logits, lse, grad_lse, target_local, owns_target, grad_target, num_rows,
                                             num_cols, own_columns_gradient(grad_numeric, ctx.layout), out=out)
            if in_place:
                torch.autograd.graph.increment_version(logits)  # the logits now hold their gradient
            return grad, None, None, None, None, None, None, None, None, None
        grad = logits.float() - lse[:, None] if logits.dtype == torch.float32 else logits.float().sub_(lse[:, None])
        grad.exp_().mul_(grad_lse[:, None])
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad.index_put_((rows, target_local), torch.where(owns_target, grad_target, 0.0), accumulate=True)
        if num_rows.numel() and num_cols.numel():
            grad.index_put_((num_rows[:, None], num_cols[None, :]), own_columns_gradient(grad_numeric, ctx.layout),
                            accumulate=True)
        return grad.to(logits.dtype), None, None, None, None, None, None, None, None, None


class _SparseGradient:
    """Adds a numeric-only term's [M, n_local] gradient into the dense gradient of `logits`.

    It is a hook on `logits`: autograd calls it once every consumer of `logits` has run, with their summed
    gradient. When another consumer (the caller's cross-entropy on the same tensor) produced one, the
    term's M x n_local entries are added into that buffer in place, so the term writes no [T, V] tensor of
    its own (a buffer that cannot be written in place, a broadcast view or another dtype, is copied
    first). When the term is the only consumer, autograd has no gradient for `logits` (and a hook may not
    invent one), so the hook runs a nested backward from `logits` with the dense gradient (zeros plus
    those entries): the cost of an ordinary dense gradient, only in that case.
    """

    def __init__(self, logits: torch.Tensor, num_rows: torch.Tensor, num_cols: torch.Tensor):
        # Not the tensor (a cycle through its own hook; a slice made for the call is gone by backward):
        # its geometry, and the autograd edge a nested backward starts from.
        self.shape, self.dtype, self.device = logits.shape, logits.dtype, logits.device
        self.edge = torch.autograd.graph.get_gradient_edge(logits) if logits.requires_grad else None
        self.num_rows, self.num_cols = num_rows, num_cols
        self.pending: list[torch.Tensor] = []  # filled by the term's backward, emptied by the hook

    def _add_into(self, grad: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        flat = grad.view(-1, grad.shape[-1])
        flat.index_put_((self.num_rows[:, None], self.num_cols[None, :]), values.to(grad.dtype), accumulate=True)
        return grad

    def __call__(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        if not self.pending:
            return None  # this call's term was not part of this backward: leave the gradient alone
        values = self.pending.pop()
        # The edge leads back to `logits` (and its graph), which holds this hook: drop it once used, or
        # every call would keep its logits alive through that cycle.
        edge, self.edge = self.edge, None
        if grad is not None:
            if not grad.is_contiguous() or grad.dtype != self.dtype:
                grad = grad.to(self.dtype, memory_format=torch.contiguous_format, copy=True)
            return self._add_into(grad, values)
        if edge is None:
            raise RuntimeError("a second backward through a numeric-only term that is the only consumer of its"
                               " logits is not supported; add it to a loss that also uses those logits")
        dense = self._add_into(torch.zeros(self.shape, dtype=self.dtype, device=self.device), values)
        torch.autograd.backward([edge], [dense], retain_graph=True)
        return None


class _NumericColumnsFn(torch.autograd.Function):
    """logits [..., V_local] -> [M, N] fp32 numeric logits at the numeric rows, the same on every TP rank.

    Reads M x n_local entries and nothing else. Backward hands this rank's columns' gradient to the
    `_SparseGradient` hook registered on `logits` instead of returning a dense [T, V] gradient. One
    collective with a TP group (`exchange_numeric_columns`), none in backward (each rank keeps its own
    columns' gradient).
    """

    @staticmethod
    def forward(ctx, logits, num_rows, num_cols, layout, group, sink):
        flat = logits.reshape(-1, logits.shape[-1])
        owned = flat[num_rows[:, None], num_cols[None, :]].float()
        ctx.layout, ctx.sink = layout, sink
        return exchange_numeric_columns(owned, layout, group)

    @staticmethod
    def backward(ctx, grad_numeric):
        ctx.sink.pending.append(own_columns_gradient(grad_numeric, ctx.layout))
        return None, None, None, None, None, None


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

    def stats(self, lse, target_logit, numeric_logits) -> LogitStats:
        """Assemble `LogitStats` from a pass's outputs (numeric logits [M, N], the same on every rank)."""
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
    """Validate labels against the global vocab and locate targets and numeric columns in the shard.

    The global vocab size is the logits width without a group, and with one the size the ranks' shards
    tile (learnt from the layout exchange): a vocabulary built without `vocab_size` works at any width
    above its largest id either way. One built with an explicit `vocab_size` must agree with the shards.
    """
    tp = world_size(group)
    if tp == 1 and vocab_start != 0:
        raise ValueError(f"vocab_start={vocab_start} without a TP group: the logits must be the full vocabulary")
    if vocab_start < 0:
        raise ValueError(f"vocab_start={vocab_start} must be >= 0")
    if tp == 1 and int(vocab.token_ids.max()) >= vocab_local:
        raise ValueError(f"{vocab.name}: numeric token id {int(vocab.token_ids.max())} does not fit logits"
                         f" of width {vocab_local}")
    layout = vocab.memo(
        ("layout", id(group), tp, rank_in(group), vocab_start, vocab_local),
        lambda: ShardLayout.exchange(vocab.token_ids, vocab_start, vocab_local, group),
    )
    vocab_size = layout.vocab_size
    if tp > 1 and vocab.vocab_size_fixed and vocab.vocab_size != vocab_size:
        raise ValueError(f"{vocab.name} was built for vocab_size={vocab.vocab_size}, but the TP ranks' logit"
                         f" shards tile [0, {vocab_size}) (this rank: [{vocab_start}, {vocab_start + vocab_local}));"
                         " build it with the model's logits width, or without vocab_size")
    flat_labels = labels.reshape(-1).to(device)
    valid = validate_labels(flat_labels, vocab_size, ignore_index)

    column = numeric_column(flat_labels, valid, vocab)
    is_numeric = (column >= 0) if numeric else torch.zeros_like(valid)

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


def _check_logits(logits: torch.Tensor, labels: torch.Tensor) -> None:
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} do not align:"
                         " expected logits [..., V] with labels [...]")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")


def compute_logit_stats(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab: NumericVocab,
    group=None,
    vocab_start: int = 0,
    ignore_index: int = IGNORE_INDEX,
    numeric: bool = True,
    *,
    fused: bool | None = None,
    grad_in_place: bool = False,
) -> LogitStats:
    """One pass over `logits` [..., V_local] with `labels` [...] (aligned; the caller shifts).

    Parallel contract: with `group` (TP ranks), `logits` is this rank's shard of the vocab range
    [vocab_start, vocab_start + V_local), `labels` are identical on every rank, and the global vocab
    size is `vocab.vocab_size`. The returned stats are identical on every rank (up to which rank's
    gradient flows into which shard). Without a group the logits are the full vocabulary.
    `numeric=False` skips the numeric columns (M = 0, no gather): what plain CE needs.

    `fused`: run the pass as the Triton kernels of `numloss.fused_pass` (None: on CUDA when triton
    imports, unless NUMLOSS_FUSED=0; see `fused_pass.use_fused`); the eager code is the reference.
    `grad_in_place=True` (fused only; ignored by the eager path): the logits are dead after this loss, and
    the caller must not read them again: backward writes their gradient into their own storage instead of
    a new [T, V] buffer, and bumps their version counter, so a later autograd use of them raises.
    """
    _check_logits(logits, labels)
    v_local = logits.shape[-1]
    plan = plan_labels(labels, vocab, v_local, logits.device, group, vocab_start, ignore_index, numeric)
    run_fused = fused_pass.use_fused(logits, fused)
    lse, target_logit, numeric_logits = _LogitStatsFn.apply(
        logits.reshape(-1, v_local), plan.target_local, plan.owns_target, plan.valid, plan.num_rows,
        plan.layout.local_cols.to(logits.device), plan.layout, group, run_fused, run_fused and grad_in_place,
    )
    return plan.stats(lse, target_logit, numeric_logits)


def numeric_logit_stats(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab: NumericVocab,
    group=None,
    vocab_start: int = 0,
    ignore_index: int = IGNORE_INDEX,
) -> LogitStats:
    """Stats with only the numeric slice: the [M, N] numeric logits at the numeric positions, the labels
    and the runs, but no full-vocabulary log-sum-exp (reading `lse`, `target_logit`, `ce_per_token` or
    `numeric.lse` raises). For terms renormalised over the numeric tokens: they need no pass over the
    vocabulary, and their gradient is added into the dense gradient that reaches `logits` from other
    consumers, in place (see `_SparseGradient`): with `torch.nn.functional.cross_entropy` on the same
    tensor, the term writes no [T, V] buffer. Alone, `logits` gets a dense gradient as usual.

    Same arguments and parallel contract as `compute_logit_stats`; one collective with a TP group.
    """
    _check_logits(logits, labels)
    plan = plan_labels(labels, vocab, logits.shape[-1], logits.device, group, vocab_start, ignore_index)
    local_cols = plan.layout.local_cols.to(logits.device)
    sink = _SparseGradient(logits, plan.num_rows, local_cols)
    numeric_logits = _NumericColumnsFn.apply(logits, plan.num_rows, local_cols, plan.layout, group, sink)
    if logits.requires_grad and torch.is_grad_enabled():
        logits.register_hook(sink)
    return NumericOnlyStats(
        labels=plan.labels,
        valid=plan.valid,
        lse=None,
        target_logit=None,
        numeric=NumericOnlyRows(plan.num_rows, plan.column[plan.num_rows], numeric_logits, None),
        shape=plan.shape,
        is_numeric=plan.is_numeric,
    )
