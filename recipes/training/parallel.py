"""Data parallelism as the shared loop sees it: this rank's replica, the step's global loss counts, and
the sum of the logged values over the replicas.

A step is `grad_accum` micro-batches on each of the data-parallel ranks. Before the first forward the
step's micro-batches are read ahead and counted from their labels alone (valid tokens, numeric
positions, sequences, ...; `numloss.normalization`), and one SUM all-reduce over the data-parallel
group gives the step's counts (`step_counts`). Each micro-batch's loss is then its share of the whole
global batch's loss, whatever the engine; each engine undoes its own averaging over micro-batches and
ranks (see its `train_step`). Tensor- and pipeline-parallel ranks of one replica hold the same rows and
labels: they take no part in the count's all-reduce and compute the same counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from numloss.normalization import LossCounts, reduce_counts
from recipes.parallel_dims import ParallelDims


@dataclass
class DataParallel:
    """This rank's place among the data-parallel replicas: `rank` in `[0, size)`, and the process group
    of the ranks holding the other replicas of the same model shard (None: the whole world)."""

    rank: int
    size: int
    group: object

    @classmethod
    def tensor_parallel_first(cls, world_rank: int, world_size: int, tp: int) -> "DataParallel":
        """AutoTP's layout: tensor-parallel groups are consecutive ranks, so the data-parallel group of
        rank r is every rank with the same r mod tp. Every rank must call it (it makes every group)."""
        if tp == 1:
            return cls(world_rank, world_size, None)
        groups = [dist.new_group(list(range(t, world_size, tp))) for t in range(tp)]
        return cls(world_rank // tp, ParallelDims.of(world_size, tp=tp).dp, groups[world_rank % tp])


def step_counts(count: Callable[..., LossCounts], window: list[dict], dp: DataParallel) -> LossCounts:
    """The loss denominators of the whole global batch: `count(labels, sequence_ids)` of each of this
    rank's micro-batches, summed over the data-parallel group in one all-reduce. Call before the first
    forward of the step, on every rank."""
    return reduce_counts([count(inputs["labels"], inputs.get("sequence_ids")) for inputs in window], group=dp.group)


def reduce_sum(values: dict[str, float], device: torch.device, group=None) -> dict[str, float]:
    """Sum over the data-parallel group of a dict of floats (every rank holds the same keys)."""
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return dict(zip(keys, t.tolist()))
