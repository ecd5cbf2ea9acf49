"""The objective on rows split along the sequence over ranks (sequence or context parallelism).

Under DeepSpeed-Ulysses or Megatron's context parallelism a rank holds some positions of every row (a
contiguous slice, or Megatron's two load-balanced chunks) and its logits there. Every term must still
give the value and gradient it gives on the whole row. What a rank cannot know from its own positions:

- what depends on the labels alone and reads a number or a row whole: DIST2's and NTIL's places (the
  numeric tokens after a position in its run), DEL's place weights (digit-and-point runs), NTIL's digit
  positions and runs per sequence, and whether a row (packed: an example) counts as a sequence. The
  ranks of a split read the same rows, so each one computes these on the WHOLE row (its labels, already
  shifted, before the split) and keeps them at its own positions, exactly as the shifted labels travel:
  no communication.
- what depends on the logits and spans the split: NTIL's rebuilt number x̂ = Σ_t d̂_t·10^k_t of a run
  whose digits lie on several ranks. It is additive over positions, so each rank sums its own digits'
  part and one SUM all-reduce over the split's ranks adds the parts of every straddling run (a float64
  per straddling run of the micro-batch; never logits). Every rank then holds the run's x̂; the run's
  value counts once, on the rank that holds its first digit, while every rank takes the value's
  gradient with respect to x̂ for its own digits (the all-reduce's backward is the identity), so each
  rank's backward yields the gradient of its own positions and nothing crosses in backward.

Counts (`numloss.normalization`): each rank counts its own positions (tokens, numeric positions, their
whole-row place weights) and the sequences whose first valid label it holds, so the counts summed over
the data-parallel and the split's ranks are the whole global batch's, each row once.

    split = SequenceSplit.contiguous(labels, rank=sp_rank, world=sp_size, group=sp_group)
    local = split.local(labels)                                     # this rank's positions
    counts = reduce_counts([objective.counts(local, sequence_split=split), ...], group=dp_x_sp_group)
    out = objective(logits_local, local, group=tp_group, counts=counts, sequence_split=split)

A term of the registry is exact under a split when it sums per-position values of its own positions'
statistics and reads the row's structure only through `stats.runs` (or `stats.split`): its registration
says so (`register_term(..., splits=True)`); the objective refuses a split for any other term.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import cached_property

import torch

from .logit_stats import IGNORE_INDEX, numeric_column
from .normalization import (NUMERIC, PLACE_VALUE, SEQUENCES, TOKENS, LossCounts, batch_counts, place_value_weights,
                            sequence_index)
from .parallel import all_reduce_, rank_in, world_size
from .runs import NumericRuns, numeric_runs
from .vocab import NumericVocab


@dataclass(frozen=True)
class SequenceSplit:
    """How every row of a micro-batch is split along its last dimension over the ranks of `group`.

    `labels` [..., S]: the WHOLE rows' labels, shifted (position t holds token t+1), the same on every rank
    of the split. `owner` [S]: the split rank holding each position. `rank`: this rank's index in `group`
    (the sequence- or context-parallel group; None with world 1). `sequence_ids` [..., S]: packed rows'
    example ids of the whole rows, or None (each row one sequence)."""

    labels: torch.Tensor
    owner: torch.Tensor
    rank: int
    group: object = None
    sequence_ids: torch.Tensor | None = None

    def __post_init__(self):
        if self.labels.dim() == 0:
            raise ValueError("SequenceSplit: labels must have a sequence dimension")
        length = self.labels.shape[-1]
        if self.owner.shape != (length,):
            raise ValueError(f"SequenceSplit: owner {tuple(self.owner.shape)} must have one rank per position ({length})")
        world = world_size(self.group) if self.group is not None else int(self.owner.max()) + 1 if length else 1
        if self.group is not None and rank_in(self.group) != self.rank:
            raise ValueError(f"SequenceSplit: rank {self.rank} is not this process's rank {rank_in(self.group)} in the group")
        if length and (int(self.owner.min()) < 0 or int(self.owner.max()) >= world):
            raise ValueError(f"SequenceSplit: owner ranks must lie in [0, {world}) (the group's size)")
        if self.sequence_ids is not None and self.sequence_ids.shape != self.labels.shape:
            raise ValueError(f"SequenceSplit: sequence_ids {tuple(self.sequence_ids.shape)} must match the labels"
                             f" {tuple(self.labels.shape)}")
        if not (self.owner == self.rank).any():
            raise ValueError(f"SequenceSplit: rank {self.rank} holds no position of the rows")

    @classmethod
    def contiguous(cls, labels: torch.Tensor, rank: int, world: int, group=None,
                   sequence_ids: torch.Tensor | None = None) -> "SequenceSplit":
        """Rank r holds positions [r·S/world, (r+1)·S/world) (DeepSpeed-Ulysses' split); S must divide."""
        length = labels.shape[-1]
        if world < 1 or length % world:
            raise ValueError(f"SequenceSplit.contiguous: a row of {length} positions does not split evenly over"
                             f" {world} ranks (pad the rows to a multiple of the sequence-parallel size)")
        owner = torch.arange(length, device=labels.device) // (length // world)
        return cls(labels, owner, rank, group, sequence_ids)

    @classmethod
    def load_balanced(cls, labels: torch.Tensor, rank: int, world: int, group=None,
                      sequence_ids: torch.Tensor | None = None) -> "SequenceSplit":
        """Megatron's context-parallel split: the row in 2·world equal chunks, rank r holding chunks r and
        2·world - 1 - r (each rank then has as much causal attention work); S must divide by 2·world."""
        length = labels.shape[-1]
        if world < 1 or length % (2 * world):
            raise ValueError(f"SequenceSplit.load_balanced: a row of {length} positions does not split into"
                             f" {2 * world} equal chunks (pad the rows to a multiple of 2 x the context-parallel size)")
        chunk = torch.arange(length, device=labels.device) // (length // (2 * world))
        owner = torch.where(chunk < world, chunk, 2 * world - 1 - chunk)
        return cls(labels, owner, rank, group, sequence_ids)

    @property
    def world(self) -> int:
        """The ranks of the split (without a group: as many as the owners name; then nothing can cross)."""
        return world_size(self.group) if self.group is not None else int(self.owner.max()) + 1

    @cached_property
    def positions(self) -> torch.Tensor:
        """[S_local] the positions of each row this rank holds, increasing."""
        return (self.owner == self.rank).nonzero().flatten()

    def local(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's positions of a whole-row tensor [..., S] (labels, input ids, sequence ids)."""
        return whole.index_select(-1, self.positions.to(whole.device))

    def view(self, vocab: NumericVocab, ignore_index: int = IGNORE_INDEX) -> "SplitView":
        return SplitView(self, vocab, ignore_index)


class SplitView:
    """A `SequenceSplit` read with one numeric vocabulary: the whole rows' label structure, and how this
    rank's flat positions map into it. Labels only; built once per objective call."""

    def __init__(self, split: SequenceSplit, vocab: NumericVocab, ignore_index: int):
        self.split, self.vocab, self.ignore_index = split, vocab, ignore_index
        labels = split.labels
        self.shape = labels.shape  # the whole rows'
        self.length = labels.shape[-1]
        self.labels = labels.reshape(-1)
        self.valid = self.labels != ignore_index
        self.is_numeric = numeric_column(self.labels, self.valid, vocab) >= 0
        positions = split.positions.to(labels.device)
        rows = self.labels.numel() // max(self.length, 1)
        # [T_local] whole flat index of each local flat position (rows stay rows; positions within them)
        self.to_whole = (torch.arange(rows, device=labels.device)[:, None] * self.length + positions[None, :]).reshape(-1)
        self.local_shape = torch.Size((*labels.shape[:-1], positions.numel()))
        self.owner = split.owner.to(labels.device).repeat(rows)  # [T_whole]
        self.rank, self.group = split.rank, split.group
        # index of each whole flat position among the whole rows' numeric positions (-1 elsewhere)
        self.numeric_index = torch.where(self.is_numeric, self.is_numeric.long().cumsum(0) - 1, -1)

    def check_local(self, local_labels: torch.Tensor) -> None:
        """The local labels are the whole rows' at this rank's positions (else the split is not theirs)."""
        flat = local_labels.reshape(-1).to(self.labels.device)
        if tuple(local_labels.shape) != tuple(self.local_shape) or not torch.equal(flat, self.labels[self.to_whole]):
            raise ValueError(f"sequence_split: the labels {tuple(local_labels.shape)} are not this rank's positions of"
                             f" the split's whole rows {tuple(self.shape)} (expected split.local(whole labels),"
                             f" shape {tuple(self.local_shape)})")

    @cached_property
    def runs(self) -> NumericRuns:
        """The whole rows' maximal numeric runs (`numloss.runs`)."""
        return numeric_runs(self.is_numeric.view(self.shape))

    def whole_numeric(self, local_rows: torch.Tensor) -> torch.Tensor:
        """[M_local] index among the whole rows' numeric positions of each local numeric flat position."""
        return self.numeric_index[self.to_whole[local_rows.to(self.to_whole.device)]]

    def local_runs(self, local_rows: torch.Tensor) -> NumericRuns:
        """`NumericRuns` of this rank's numeric positions with the whole rows' places (`after`): runs that
        straddle the split keep their members' places; run ids are renumbered over this rank's runs."""
        whole = self.runs
        index = self.whole_numeric(local_rows)
        whole_run = whole.run_id[index]
        keys, run_id = torch.unique(whole_run, return_inverse=True)
        local_length = max(self.local_shape[-1], 1)
        seq_of_position = local_rows // local_length
        seq_of_run = torch.zeros(keys.numel(), dtype=torch.long, device=local_rows.device)
        seq_of_run[run_id] = seq_of_position
        return NumericRuns(run_id, whole.after[index], seq_of_position, seq_of_run,
                           torch.bincount(run_id, minlength=keys.numel()), whole.num_sequences)

    def run_owner(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([R_whole] the rank holding each whole run's first position, [R_whole] whether the run's members
        lie on more than one rank)."""
        whole = self.runs
        flat = self.is_numeric.nonzero().flatten()
        owners = self.owner[flat]
        empty = torch.zeros(whole.num_runs, dtype=torch.long, device=flat.device)
        first_position = empty.scatter_reduce(0, whole.run_id, flat, reduce="amin", include_self=False)
        low = empty.scatter_reduce(0, whole.run_id, owners, reduce="amin", include_self=False)
        high = empty.scatter_reduce(0, whole.run_id, owners, reduce="amax", include_self=False)
        return self.owner[first_position], low != high

    def sequences_held(self, sequence_ids: torch.Tensor | None) -> torch.Tensor:
        """[S_whole] bool: the whole rows' sequences with a valid label whose first valid label is on this
        rank (so that a sequence counts once over the split)."""
        index, n = sequence_index(self.shape, sequence_ids, self.labels.device)
        flat = torch.arange(self.labels.numel(), device=self.labels.device)
        first = torch.full((n,), self.labels.numel(), dtype=torch.long, device=flat.device).scatter_reduce(
            0, index[self.valid], flat[self.valid], reduce="amin", include_self=True)
        has_valid = first < self.labels.numel()
        return has_valid & (self.owner[first.clamp(max=max(self.labels.numel() - 1, 0))] == self.rank)


class _SumOverSplit(torch.autograd.Function):
    """Forward: SUM all-reduce over the split's ranks of each rank's parts. Backward: the identity (each
    rank's parts get the gradient of the summed value that rank's own loss takes: see the module doc)."""

    @staticmethod
    def forward(ctx, parts, group):
        return all_reduce_(parts.clone(), "sum", group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def sum_over_split(parts: torch.Tensor, group) -> torch.Tensor:
    """Every rank's `parts` summed over the split's ranks (one collective), with an identity backward."""
    return _SumOverSplit.apply(parts, group)


def counted_once(value: torch.Tensor, here: torch.Tensor) -> torch.Tensor:
    """`value` where `here` (this rank counts it), else 0 in value with `value`'s gradient kept: an item
    that every rank of the split computes counts once in the sum of their losses, while each rank still
    backpropagates it into its own positions."""
    return torch.where(here, value, value - value.detach())


def split_counts(view: SplitView, keys, local_labels: torch.Tensor,
                 position_weights: dict[str, torch.Tensor] | None = None) -> LossCounts:
    """This rank's share of a split micro-batch's counts `keys` (see the module docstring): summed over the
    split's ranks they are the whole rows' `numloss.normalization.batch_counts`."""
    view.check_local(local_labels)
    valid = view.valid[view.to_whole]
    numeric = view.is_numeric[view.to_whole]
    out: dict[str, float] = {}
    for key in sorted(set(keys)):
        if key == TOKENS:
            out[key] = float(valid.sum())
        elif key == NUMERIC:
            out[key] = float(numeric.sum())
        elif key == PLACE_VALUE:
            local_rows = numeric.nonzero().flatten()
            out[key] = float(place_value_weights(view.runs.after[view.whole_numeric(local_rows)]).sum())
        elif key == SEQUENCES:
            out[key] = float(view.sequences_held(view.split.sequence_ids).sum())
        elif key.endswith(".position_weights"):
            weights = (position_weights or {}).get(key)
            if weights is None or weights.shape != local_labels.shape:
                raise ValueError(f"count {key!r} needs that term's position_weights shaped like this rank's labels"
                                 f" {tuple(local_labels.shape)}")
            out[key] = float(weights.reshape(-1).to(torch.float32)[numeric].sum())
        else:
            raise ValueError(f"unknown count {key!r}; known: {TOKENS}, {NUMERIC}, {PLACE_VALUE}, {SEQUENCES},"
                             " <term>.position_weights")
    return LossCounts(out)


def whole_counts(view: SplitView, keys) -> LossCounts:
    """The whole rows' counts of one split micro-batch, from the whole labels every rank holds (no
    collective): the denominators when the caller passes no step counts."""
    if any(key.endswith(".position_weights") for key in keys):
        raise ValueError("sequence_split: a term with position_weights needs the step's counts (counts=), summed"
                         " over the split's ranks from Objective.counts(..., sequence_split=)")
    return batch_counts(view.split.labels, view.vocab, keys, view.ignore_index, sequence_ids=view.split.sequence_ids)


def replace_split(stats, view: SplitView):
    """A shallow copy of `stats` that carries `view` (its runs then come from the whole rows)."""
    out = copy.copy(stats)
    out.__dict__.pop("runs", None)  # a cached property computed without the split
    out.split = view
    return out
