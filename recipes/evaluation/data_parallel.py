"""Data-parallel Hugging Face evaluation: under torchrun every rank holds the whole model and generates a
share of the rows; the texts are gathered on every rank and scored once, so the results equal one process's.

    torchrun --nproc_per_node 8 -m recipes.evaluate --model DIR --data DIR --backend hf

Rows are dealt round-robin in prompt-length order, so every rank's batches pad about as little as one
process's. Greedy decoding of a left-padded batch gives each row what it gives alone (tested on the CPU), so
the split does not change an answer; on a GPU, bf16 kernels may round differently at another batch shape.
Texts travel as Python objects over a gloo group (CPU memory, any accelerator) with a timeout.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Sequence

GATHER_TIMEOUT_MINUTES = 60  # a rank that dies mid-generation ends the others' wait


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def ranks_from_env() -> Ranks:
    """The rank, world size and local rank torchrun sets (one process without them)."""
    return Ranks(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                 int(os.environ.get("LOCAL_RANK", 0)))


def share(rows: Sequence[dict], ranks: Ranks) -> list[int]:
    """The row indices of this rank: rows in prompt-length order, dealt round-robin."""
    order = sorted(range(len(rows)), key=lambda i: (len(rows[i]["prompt_ids"]), i))
    return order[ranks.rank::ranks.world]


def device_of(ranks: Ranks, device: str | None) -> str | None:
    """This rank's device: the one asked for, else its local GPU where there are GPUs, else the CPU."""
    if device or ranks.world == 1:
        return device
    import torch

    return f"cuda:{ranks.local_rank}" if torch.cuda.is_available() else "cpu"


class ProcessGroup:
    """A gloo process group for the gather, opened if torchrun started us and none is open; closed after."""

    def __init__(self, ranks: Ranks, timeout_minutes: float = GATHER_TIMEOUT_MINUTES):
        import torch.distributed as dist

        self.dist, self.ranks, self.opened = dist, ranks, False
        if ranks.world > 1 and not dist.is_initialized():
            dist.init_process_group("gloo", timeout=timedelta(minutes=timeout_minutes))
            self.opened = True

    def gather(self, texts: dict[int, str], n: int) -> list[str]:
        """Every rank's {row index: text} as one list in row order, on every rank."""
        if self.ranks.world == 1:
            parts = [texts]
        else:
            parts = [None] * self.ranks.world
            self.dist.all_gather_object(parts, texts)
        merged: dict[int, str] = {}
        for part in parts:
            merged.update(part)
        missing = [i for i in range(n) if i not in merged]
        if missing:
            raise RuntimeError(f"data-parallel evaluation: no text for rows {missing[:5]} (of {n})")
        return [merged[i] for i in range(n)]

    def close(self) -> None:
        if self.opened:
            self.dist.destroy_process_group()
            self.opened = False
