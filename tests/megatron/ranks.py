"""`run_ranks` with a deadline: a multi-process gloo test that hangs (a collective one rank never
joins) is killed and fails instead of blocking the suite. The per-rank entry is `tests.distributed`'s."""

from __future__ import annotations

import os
import tempfile
import time

import torch.multiprocessing as mp

from tests.distributed import _entry


def run_ranks(world: int, fn, *args, timeout: float = 240.0) -> None:
    """Call `fn(rank, world, *args)` in `world` spawned processes (default group: gloo); fail with the
    first failing rank's traceback, or with TimeoutError after `timeout` seconds (every rank killed)."""
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(_entry, args=(world, os.path.join(tmp, "init"), fn, args), nprocs=world,
                                     join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=max(0.0, deadline - time.monotonic())):  # raises on a rank's error
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{fn.__name__} on {world} ranks ran past {timeout:.0f} s")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join(5)
