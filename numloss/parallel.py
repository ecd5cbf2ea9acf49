"""Tensor-parallel communication for the losses, and a counter of what it sends.

Everything here takes `group`: a torch.distributed process group of the tensor-parallel (TP) ranks, or
None for no tensor parallelism (then every function is a local no-op and nothing is sent).

Contract (DESIGN.md, "The vocab-parallel contract"): labels are replicated across the group; each rank
holds logits for the vocab range [vocab_start, vocab_start + V_local). Only three collectives run per
step: a MAX all-reduce and a packed SUM all-reduce for the log-sum-exp (see `logit_stats.py`), and one
all-gather of the numeric columns at numeric rows (`gather_numeric_columns`). The first call on a new
(group, shard) also exchanges the shard layout once (`ShardLayout.exchange`); it is cached after that.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# ---- counting collectives ---------------------------------------------------------------------------


@dataclass
class CommRecord:
    op: str
    bytes: int  # bytes this rank contributes to the collective (its input tensor)


@dataclass
class CommCounter:
    """The collectives issued while it is active: `with count_comm() as c: ...; c.records`."""

    records: list[CommRecord] = field(default_factory=list)

    @property
    def calls(self) -> int:
        return len(self.records)

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.records)

    def ops(self) -> list[str]:
        return [r.op for r in self.records]


_ACTIVE_COUNTERS: list[CommCounter] = []


@contextlib.contextmanager
def count_comm():
    """Record every collective numloss issues (forward and backward) inside the block."""
    counter = CommCounter()
    _ACTIVE_COUNTERS.append(counter)
    try:
        yield counter
    finally:
        _ACTIVE_COUNTERS.remove(counter)


def _record(op: str, tensor: torch.Tensor) -> None:
    for counter in _ACTIVE_COUNTERS:
        counter.records.append(CommRecord(op, tensor.numel() * tensor.element_size()))


# ---- plain collectives (no autograd) ----------------------------------------------------------------


def world_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def rank_in(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce_(tensor: torch.Tensor, op: str, group) -> torch.Tensor:
    """In-place all-reduce ("max" or "sum") over `group`; identity when there is no group."""
    if group is None or dist.get_world_size(group) == 1:
        return tensor
    _record(f"all_reduce_{op}", tensor)
    reduce_op = {"max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}[op]
    dist.all_reduce(tensor, op=reduce_op, group=group)
    return tensor


def all_gather(tensor: torch.Tensor, group) -> torch.Tensor:
    """[world, *tensor.shape]: every rank's tensor, stacked in rank order."""
    if group is None or dist.get_world_size(group) == 1:
        return tensor.unsqueeze(0)
    _record("all_gather", tensor)
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.stack(parts)


# ---- where the numeric columns live -----------------------------------------------------------------


@dataclass(frozen=True)
class ShardLayout:
    """Which numeric columns each TP rank owns, for one vocabulary and one sharding of the logits.

    `local_cols` are the positions inside this rank's logits shard of the numeric tokens it owns;
    `owned` their numeric-column indices. `slot_of_column[c]` says where numeric column c sits in the
    flattened all-gather of [world, width]: rank r's owned columns are padded to the common `width`.
    """

    owned: torch.Tensor  # [n_local] numeric-column indices owned here
    local_cols: torch.Tensor  # [n_local] their offsets in the local logits shard
    width: int  # max over ranks of n_local: the common padded width
    slot_of_column: torch.Tensor  # [N] index into the flattened [world * width] gather

    @staticmethod
    def exchange(token_ids: torch.Tensor, vocab_start: int, vocab_local: int, group) -> "ShardLayout":
        """Build the layout; with a group, all-gathers every rank's (start, width) once."""
        token_ids = token_ids.cpu()
        device = token_ids.device
        if group is None or dist.get_world_size(group) == 1:
            ranges = torch.tensor([[vocab_start, vocab_local]])
        else:
            mine = torch.tensor([vocab_start, vocab_local], dtype=torch.long)
            ranges = all_gather(mine, group)
        world = ranges.shape[0]
        owner = torch.full((token_ids.numel(),), -1, dtype=torch.long)
        for r in range(world):  # world is the TP size: a handful of iterations, once per layout
            start, size = int(ranges[r, 0]), int(ranges[r, 1])
            inside = (token_ids >= start) & (token_ids < start + size)
            if (owner[inside] >= 0).any():
                raise ValueError(f"TP rank {r}'s vocab range [{start}, {start + size}) overlaps another rank's")
            owner[inside] = r
        if (owner < 0).any():
            missing = int(token_ids[owner < 0][0])
            raise ValueError(
                f"numeric token id {missing} lies in no TP rank's vocab range {ranges.tolist()}:"
                " the shards must cover the vocabulary"
            )
        counts = torch.bincount(owner, minlength=world)
        width = int(counts.max())
        # slot within its rank: the order of columns of the same owner
        slot = torch.empty_like(owner)
        for r in range(world):
            cols = (owner == r).nonzero().flatten()
            slot[cols] = torch.arange(cols.numel())
        me = rank_in(group)
        owned = (owner == me).nonzero().flatten()
        return ShardLayout(
            owned=owned,
            local_cols=(token_ids[owned] - vocab_start).to(device),
            width=width,
            slot_of_column=owner * width + slot,
        )


class _GatherColumns(torch.autograd.Function):
    """Forward: all-gather each rank's [M, n_local] numeric columns into [M, N].
    Backward: each rank keeps the gradient of its own columns (a split, not a reduce-scatter), because
    every rank computes the same loss from the same gathered tensor."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, width: int, slot_of_column: torch.Tensor, owned: torch.Tensor, group):
        ctx.owned = owned
        m, n_local = local.shape
        padded = local.new_zeros((m, width))
        padded[:, :n_local] = local
        gathered = all_gather(padded, group)  # [world, M, width]
        flat = gathered.permute(1, 0, 2).reshape(m, -1)
        return flat[:, slot_of_column]

    @staticmethod
    def backward(ctx, grad):
        return grad[:, ctx.owned], None, None, None, None


def gather_numeric_columns(local: torch.Tensor, layout: ShardLayout, group) -> torch.Tensor:
    """[M, N] numeric logits on every rank from each rank's [M, n_local] owned columns."""
    if group is None or dist.get_world_size(group) == 1:
        return local  # one rank owns every column, already in numeric-column order
    if local.shape[0] == 0:
        # No numeric row anywhere (labels are replicated, so every rank agrees): nothing to send, but
        # keep an [0, N] result attached to the graph so the terms reduce to an exact, trainable 0.
        return local.sum() + local.new_zeros((0, layout.slot_of_column.numel()))
    return _GatherColumns.apply(
        local, layout.width, layout.slot_of_column.to(local.device), layout.owned.to(local.device), group
    )
