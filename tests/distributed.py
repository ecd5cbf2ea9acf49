"""Run a function on several real processes joined in a gloo process group (no mocks), with a deadline.

The ranks start from a fork server that has imported torch and the heavy libraries once per pytest
process (`PRELOAD`): a spawned rank re-imports them, 4-10 CPU seconds each (torch alone ~3), which over
the suite's few hundred ranks was a large part of its time on 2 cores. The server only imports, it
never runs an op, so torch's OpenMP pool (which a forked child cannot use) does not exist there yet; each
rank still builds its own process group, and starts with the caller's environment as it is at the call (the
server's own is the one it had when it started)."""

from __future__ import annotations

import multiprocessing.forkserver
import multiprocessing.reduction
import os
import pickle
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing import ProcessRaisedException

# Imported once by the fork server; a module that is not installed is skipped there (the test that
# needs it skips or fails on its own).
PRELOAD = ("torch", "torch.distributed", "numpy", "numloss", "transformers", "deepspeed", "megatron.core")


class _CallerFd:
    """The caller's file descriptor `fd` as it is at the call, for the rank to write to. A forked
    rank would otherwise inherit the server's stdout and stderr, not the caller's (pytest's `capfd`
    captures by redirecting them for the length of a test)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):  # runs while the rank is being started: the fd travels with it
        return _detach, (multiprocessing.reduction.DupFd(self.fd),)


def _detach(dup) -> int:
    return dup.detach()


def _entry(rank: int, world: int, init_file: str, env: dict, stdio: tuple, fn, args):
    os.environ.clear()
    os.environ.update(env)
    for target, fd in zip((1, 2), stdio):
        os.dup2(fd, target)
        os.close(fd)
    torch.set_num_threads(1)  # 2-core machines: several ranks must not oversubscribe
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        if dist.is_initialized():  # a run of recipes.train ends its group itself (its teardown)
            dist.barrier()
    except BaseException:
        # When, before this rank's group goes down and breaks the other ranks' collectives: the clock
        # is system-wide, so `_every_error` can put the rank that failed first first.
        with open(f"{init_file}.failed.{rank}", "w") as f:
            f.write(str(time.monotonic_ns()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _start_method() -> str:
    """'forkserver' with `PRELOAD` (set before the server first starts; later calls find it running)."""
    multiprocessing.forkserver.set_forkserver_preload(list(PRELOAD))
    return "forkserver"


def _every_error(context, init_file: str) -> tuple[str, int]:
    """Every failed rank's traceback, the earliest failure first, and that rank. torch reports the
    first failed process it notices, which is often a rank whose collective broke because another rank
    had already failed (gloo's "Connection reset by peer"), not the rank that failed first."""
    found = []
    for rank, path in enumerate(context.error_files):
        if path and os.path.exists(path) and os.path.getsize(path) > 0:
            stamp = Path(f"{init_file}.failed.{rank}")
            when = int(stamp.read_text()) if stamp.exists() else time.monotonic_ns()
            with open(path, "rb") as fh:
                found.append((when, rank, pickle.load(fh)))
    found.sort()
    text = "".join(f"\n\n-- rank {rank} failed ({i} of {len(found)}, earliest first):\n{trace}"
                   for i, (_, rank, trace) in enumerate(found, 1))
    return text, found[0][1] if found else -1


def run_ranks(world: int, fn, *args, timeout: float = 240.0) -> None:
    """Call `fn(rank, world, *args)` in `world` processes with the default group (gloo) initialised.

    `fn` must be importable (module level). Fails with every failed rank's traceback, earliest first, or with
    TimeoutError after `timeout` seconds (every rank killed): a collective that one rank never joins
    fails the test instead of blocking the suite."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        context = mp.start_processes(_entry, args=(world, init_file, dict(os.environ),
                                                     (_CallerFd(1), _CallerFd(2)), fn, args),
                                     nprocs=world, join=False, start_method=_start_method())
        deadline = time.monotonic() + timeout
        try:
            try:
                while not context.join(timeout=max(0.0, deadline - time.monotonic())):  # raises on a rank's error
                    if time.monotonic() >= deadline:
                        raise TimeoutError(f"{fn.__name__} on {world} ranks ran past {timeout:.0f} s")
            except ProcessRaisedException as error:
                try:
                    text, rank = _every_error(context, init_file)
                except (OSError, EOFError, pickle.UnpicklingError, ValueError):
                    raise error from None  # torch's error files in a form this does not read: torch's own report
                if not text:
                    raise
                raise ProcessRaisedException(text, rank, context.processes[rank].pid) from None
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join(5)


def _train_rank(rank: int, world: int, argv: list[str], hooks: str | None, result: str, log: str | None) -> None:
    """One rank of `train_in_ranks`: the variables torchrun would set, then the run; its outcome (the
    exception's type and text, or none) into `result`.<rank>.json."""
    import importlib
    import json
    import sys

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    if log is not None:  # both streams, every rank, appended as a torchrun job's shared output would be
        sink = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        for fd in (1, 2):
            os.dup2(sink, fd)
        os.close(sink)
        sys.stdout.reconfigure(line_buffering=True)
    from recipes.config import load_recipe
    from recipes.train import train

    outcome = {"error": None, "message": "", "last": {}}
    try:
        made = None
        if hooks:
            module, _, name = hooks.partition(":")
            made = getattr(importlib.import_module(module), name)(rank)
        outcome["last"] = train(load_recipe(argv[0], argv[1:]), made)
    except Exception as err:  # the run's own refusals and stops are what a test reads
        outcome.update(error=type(err).__name__, message=str(err))
    # this process's threads once the run has returned (its teardown done): a process group left alive
    # still has its gloo threads here, as it would at a torchrun rank's last exit handler
    outcome["threads"] = sorted(_thread_names())
    Path(f"{result}.{rank}.json").write_text(json.dumps(outcome))


def _thread_names() -> list[str]:
    names = []
    for comm in Path("/proc/self/task").glob("*/comm"):
        try:
            names.append(comm.read_text().strip())
        except OSError:  # a thread that ended while we looked
            continue
    return names


def train_in_ranks(world: int, argv: list[str], *, hooks: str | None = None, log: str | Path | None = None,
                   timeout: float = 600.0) -> list[dict]:
    """`recipes.train.train` of the recipe `argv` ([path, *overrides]) on `world` fork-server ranks that
    already hold the group (gloo): the same loop, engine and files as a torchrun of `python -m
    recipes.train`, without each rank's interpreter start and imports. For properties that are numbers
    (losses, files written, a refusal's text); a property of processes (signals, exit codes, the
    launcher's death) needs the real launch (tests/recipes/torchrun_helpers.py).

    `hooks`: "module:function", called on every rank with the rank, returning the run's `Hooks` (or None:
    the function may also patch the loop's module in that rank's process). `log`: a file that gets every
    rank's stdout and stderr (else they go to the caller's). Returns
    each rank's {"error": the exception's class name or None, "message", "last": the last row on rank 0,
    "threads": the rank's thread names after the run returned}."""
    import json

    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "outcome")
        run_ranks(world, _train_rank, list(argv), hooks, result, None if log is None else str(log),
                  timeout=timeout)
        return [json.loads(Path(f"{result}.{r}.json").read_text()) for r in range(world)]
