"""One optimizer step of `recipes.train`, normalised over the whole global batch.

A step is `grad_accum` micro-batches on each of the data-parallel ranks. Before the first forward the
step's micro-batches are read ahead and counted from their labels alone (valid tokens, numeric
positions, sequences, ...; `numloss.normalization`), and one SUM all-reduce over the data-parallel
group gives the step's counts. Each micro-batch's loss is then its share of the whole global batch's
loss. DeepSpeed 0.19.8 divides each micro-batch's loss by `gradient_accumulation_steps` in
`engine.backward` and averages gradients over the data-parallel ranks in its ZeRO reductions; the
loss given to backward is multiplied by `grad_accum * dp` to undo both, so the update is the gradient
of the global batch's loss at any layout. Tensor-parallel ranks hold the same rows and labels: they
take no part in the count's all-reduce and compute the same loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from numloss.normalization import reduce_counts


@dataclass
class DataParallel:
    """This rank's place among the data-parallel replicas. AutoTP groups are consecutive ranks, so
    the data-parallel group of rank r is every rank with the same r mod tp."""

    rank: int
    size: int
    group: object  # None: the whole world

    @classmethod
    def create(cls, world_rank: int, world_size: int, tp: int) -> "DataParallel":
        if tp == 1:
            return cls(world_rank, world_size, None)
        groups = [dist.new_group(list(range(t, world_size, tp))) for t in range(tp)]  # every rank makes every group
        return cls(world_rank // tp, world_size // tp, groups[world_rank % tp])


def train_step(engine, wrapper, window: list[dict], dp: DataParallel) -> dict[str, float]:
    """Forward, backward and DeepSpeed step for the micro-batches `window` (model inputs on the
    device); returns this rank's share of the logged values (loss, ce, term/*, numeric_positions),
    to be summed over the data-parallel group."""
    counts = reduce_counts([wrapper.counts(inputs["labels"], inputs.get("sequence_ids")) for inputs in window],
                           group=dp.group)
    scale = len(window) * dp.size  # undo DeepSpeed's mean over micro-batches and ranks
    sums: dict[str, float] = {}
    for inputs in window:
        result = engine(**inputs, loss_counts=counts)
        engine.backward(result.loss * scale)
        engine.step()
        for key, value in result.log_dict().items():
            sums[key] = sums.get(key, 0.0) + value
    return sums


def reduce_sum(values: dict[str, float], device: torch.device, group=None) -> dict[str, float]:
    """Sum over the data-parallel group of a dict of floats (every rank holds the same keys)."""
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return dict(zip(keys, t.tolist()))
