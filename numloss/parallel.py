"""Tensor-parallel communication for the losses, and a counter of what it sends.

Everything here takes `group`: a torch.distributed process group of the tensor-parallel (TP) ranks, or
None for no tensor parallelism (then every function is a local no-op and nothing is sent).

Contract: labels are replicated across the group; each rank holds logits for the vocab range
[vocab_start, vocab_start + V_local), and the ranks' ranges tile the global vocabulary [0, V). Two
collectives run per step, whatever the terms: the numeric columns at numeric rows ride in one of the two
the log-sum-exp needs (see "how the numeric columns reach every rank" below, and `logit_stats.py`). The
first call on a new (group, shard) also exchanges the shard layout once (`ShardLayout.exchange`, which
also tells the global vocab size); it is cached after that.
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


def record_collective(op: str, tensor: torch.Tensor) -> None:
    """Count a collective issued outside this module's wrappers (the step's counts: `reduce_counts`)."""
    _record(op, tensor)


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
    `vocab_size` is the global vocabulary the shards tile, [0, vocab_size): the sum of their widths.
    """

    owned: torch.Tensor  # [n_local] numeric-column indices owned here
    local_cols: torch.Tensor  # [n_local] their offsets in the local logits shard
    width: int  # max over ranks of n_local: the common padded width
    slot_of_column: torch.Tensor  # [N] index into the flattened [world * width] gather
    vocab_size: int  # the global vocabulary size the shards tile
    world: int

    @property
    def columns(self) -> int:
        """N, the number of numeric columns."""
        return self.slot_of_column.numel()

    @staticmethod
    def exchange(token_ids: torch.Tensor, vocab_start: int, vocab_local: int, group) -> "ShardLayout":
        """Build the layout; with a group, all-gathers every rank's (start, width) once.

        The ranges must tile [0, V) without gap or overlap (Megatron's and DeepSpeed's splits do): a gap
        would leave labels that no rank scores, so it is an error that names the ranges."""
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
        vocab_size = _tiled_vocab_size(ranges)
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
            vocab_size=vocab_size,
            world=world,
        )


def _tiled_vocab_size(ranges: torch.Tensor) -> int:
    """V when the (start, width) ranges tile [0, V) exactly; ValueError naming them otherwise."""
    order = ranges[:, 0].argsort()
    expected = 0
    for r in order.tolist():
        start, size = int(ranges[r, 0]), int(ranges[r, 1])
        if size < 0 or start != expected:
            what = "overlaps the one before it" if start < expected else "leaves a gap before it"
            raise ValueError(f"TP rank {r}'s vocab range [{start}, {start + size}) {what}: the ranks' ranges"
                             f" {ranges.tolist()} (start, width) must tile [0, V)")
        expected = start + size
    return expected


# ---- how the numeric columns reach every rank -------------------------------------------------------
#
# Every rank needs the same [M, N] numeric logits; rank r holds the columns it owns. Two routes, each
# riding in a collective the log-sum-exp needs anyway, so CE plus any terms costs two collectives:
#   "sum":    MAX all-reduce of the row max [T]; SUM all-reduce of (sum-exp [T], target logit [T],
#             [M, N] numeric block with zeros in the columns a rank does not own).
#   "gather": MAX all-reduce of the target logit [T] (-inf where not owned); all-gather of (local
#             log-sum-exp [T], [M, width] owned columns), combined with a log-sum-exp over ranks.
# The SUM moves every column through every rank (ring: 2(p-1)/p x M·N floats); the all-gather moves each
# rank's padded columns to all others ((p-1) x M·width), so it wins when the numeric tokens are spread
# over the ranks and loses when one rank owns most of them (the digits of a Llama vocab: all on rank 0).
# `choose_route` picks the route with fewer bytes on the wire; every rank picks the same one, since it
# depends only on T, M (replicated labels) and the layout.


def choose_route(tokens: int, rows: int, layout: ShardLayout, lse: bool = True) -> str:
    """"sum" or "gather", whichever sends fewer ring bytes per rank (see above). `lse=False`: only the
    numeric block travels (a term that needs no log-sum-exp), in a single collective."""
    p = layout.world
    ring_reduce, ring_gather = 2 * (p - 1) / p, p - 1
    lse_floats = (2 * tokens, tokens) if lse else (0, 0)  # (sum-exp and target, local lse)
    by_sum = ring_reduce * (lse_floats[0] + rows * layout.columns)
    by_gather = ring_gather * (lse_floats[1] + rows * layout.width)
    return "sum" if by_sum <= by_gather else "gather"


def scatter_owned_columns(owned_values: torch.Tensor, layout: ShardLayout, out: torch.Tensor | None = None) -> torch.Tensor:
    """[M, N] zeros with this rank's owned columns [M, n_local] written in place (`out` if given)."""
    if out is None:
        out = owned_values.new_zeros((owned_values.shape[0], layout.columns))
    out[:, layout.owned.to(out.device)] = owned_values
    return out


def pad_owned_columns(owned_values: torch.Tensor, layout: ShardLayout, out: torch.Tensor | None = None) -> torch.Tensor:
    """[M, width]: the owned columns, zero-padded to the common width (one rank's all-gather part)."""
    m, n_local = owned_values.shape
    if out is None:
        out = owned_values.new_zeros((m, layout.width))
    out[:, :n_local] = owned_values
    return out


def columns_from_gather(gathered: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """[M, N] in numeric-column order from the all-gathered [world, M, width] padded blocks."""
    world, m, width = gathered.shape
    flat = gathered.permute(1, 0, 2).reshape(m, world * width)
    return flat[:, layout.slot_of_column.to(gathered.device)]


def exchange_numeric_columns(owned_values: torch.Tensor, layout: ShardLayout, group) -> torch.Tensor:
    """[M, N] numeric logits on every rank from each rank's [M, n_local] owned columns, in one
    collective (the cheaper route). No autograd: the caller's backward keeps its own columns' gradient."""
    if group is None or dist.get_world_size(group) == 1:
        return owned_values  # one rank owns every column, already in numeric-column order
    if choose_route(0, owned_values.shape[0], layout, lse=False) == "sum":
        return all_reduce_(scatter_owned_columns(owned_values, layout), "sum", group)
    return columns_from_gather(all_gather(pad_owned_columns(owned_values, layout), group), layout)
