"""Run a function on several real processes joined in a gloo process group (no mocks)."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world: int, init_file: str, fn, args):
    torch.set_num_threads(1)  # 2-core machines: several ranks must not oversubscribe
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn, *args) -> None:
    """Call `fn(rank, world, *args)` in `world` processes with the default group initialised.

    `fn` must be importable (module level). An exception in any rank fails the caller with that
    rank's traceback."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.start_processes(_entry, args=(world, init_file, fn, args), nprocs=world, join=True, start_method="spawn")
