"""Process-level set-up for training: the distributed environment, devices, teardown.

Launched by torchrun, Ray or srun, the rank variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT) are already set; run as a plain `python -m recipes.train`, this becomes a world of one.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import importlib
import multiprocessing
import os
import socket
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Iterable

import torch


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def exit_finished(code: int = 0) -> None:
    """End a process whose run has finished without the interpreter's finalisation (freeing every torch,
    DeepSpeed and megatron-core module and object: ~4 s a rank on a loaded 2-core machine, while its
    launcher waits), where nothing can be lost by it: the run's files are written and closed (checkpoints,
    export and metrics carry their own fsyncs), its process groups ended (`teardown`). The exit handlers
    still run (logging's flush, the trackers', a test's exit report), then stdout and stderr are flushed.
    A non-daemon thread still running, or a child process (which a normal exit joins), falls back to the
    normal exit."""
    if multiprocessing.active_children() or any(
            t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    atexit._run_exitfuncs()  # what a normal exit runs first; finalisation is what follows it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def die_with_parent(parent_pid: int, ignore: Iterable[int] = ()) -> None:
    """Run first in a helper process a rank starts: the kernel SIGKILLs it when the rank's thread that
    started it ends (PR_SET_PDEATHSIG), and the signals `ignore` no longer end it. A SIGKILLed rank (OOM
    killer, torchrun's shutdown timeout, a node agent) runs no exit handler, so a long-lived helper, such
    as a multiprocessing manager's server, would otherwise outlive it under a launcher that signals the
    rank alone. And a stop request that the rank handles itself (SIGTERM from torchrun or SLURM, which
    signal the rank's whole process group) must not end a helper the rank still needs to save with.
    Where the rank is already gone (the helper was reparented before the call), it exits now."""
    import ctypes
    import signal

    for sig in ignore:
        signal.signal(sig, signal.SIG_IGN)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os._exit(0)


def import_without(module: str, *unused: str):
    """`import module` while each of `unused` (installed, optional, imported by `module` at load time only
    to offer a feature the recipes never use) reads as absent, so `module` takes its ImportError branch;
    the unused ones stay importable afterwards for whoever wants them (the run's trackers import wandb
    and mlflow themselves). A module already imported is returned as it is."""
    if module in sys.modules or any(name in sys.modules for name in unused):
        return importlib.import_module(module)
    for name in unused:
        sys.modules[name] = None  # `import name` raises ImportError
    try:
        return importlib.import_module(module)
    finally:
        for name in unused:
            del sys.modules[name]


def quiet_deprecated_collectives() -> None:
    """Ignore torch's FutureWarnings for the collectives DeepSpeed's ZeRO calls (`all_gather_into_tensor`,
    `reduce_scatter_tensor`). They are raised on every call, not once: code elsewhere enters
    `warnings.catch_warnings`, which resets the "already shown" registry, so a 60-step fine-tune on 2 CPU
    ranks wrote ~30,000 of them (7 MB) into its log. They name DeepSpeed's calls, nothing a recipe
    can change; any other warning is still shown."""
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")


def setup_distributed(timeout_minutes: float = 60.0, init_group=None) -> Runtime:
    """Initialise torch.distributed (NCCL on GPUs, gloo on the CPU) with a collective timeout of
    `timeout_minutes` (the recipe's `train.dist_timeout_minutes`; torch's default, 10 minutes, is
    shorter than a 70B checkpoint save or export). A group an orchestrator already made (Ray Train)
    keeps its own timeout: launch.ray gives Ray the same value. `init_group(backend, timeout)`: an
    engine's own way of making or adopting the group (its runtime class's `join_process_group` passes
    it); by default torch's, where no group exists yet."""
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    quiet_deprecated_collectives()
    # Imported before the world group exists: its functions' defaults are `group=group.WORLD`, evaluated at
    # import, and imported later (DeepSpeed and transformers do, lazily) they hold the world group for
    # good, so teardown could not free it before the interpreter exits (see `teardown`).
    import torch.distributed.nn.functional  # noqa: F401
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local_rank)
    backend, timeout = "nccl" if cuda else "gloo", datetime.timedelta(minutes=timeout_minutes)
    if init_group is not None:
        init_group(backend, timeout)
    elif not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend, timeout=timeout)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    return Runtime(torch.distributed.get_rank(), torch.distributed.get_world_size(), local_rank, device)


def side_store(timeout_s: float):
    """A connection of its own to the process group's key-value store (torchrun's agent store, or the
    one `init_process_group` made), with its own timeout: a thread can use it while the main thread
    waits inside a collective, which never passes through it (`recipes.reliability.watchdog`). Raises
    RuntimeError without a process group, or where the store cannot be cloned."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise RuntimeError("no process group")
    from torch.distributed.distributed_c10d import _get_default_store  # torch has no public accessor

    store = _get_default_store().clone()
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store


def teardown(engine=None) -> None:
    """End a run cleanly: the engine first (DeepSpeed's, Megatron's groups), then every process group,
    freed before the interpreter shuts down.

    `torch.distributed.destroy_process_group` only forgets the groups: a group object still referenced
    keeps its gloo worker threads alive until interpreter finalisation frees it, and a rank can then
    abort at exit ("terminate called without an active exception", exit -6) after a run that finished,
    which torchrun and Ray report as a failed job. The holders found: DeepSpeed's own group table
    (`deepspeed.comm.destroy_process_group` clears it), the engine's model and optimizer and the caches
    and module-level state of DeepSpeed and megatron-core that keep them (`engine.close` drops them,
    `clear_method_caches`), and `torch.distributed.nn.functional` imported after the world group
    existed (`setup_distributed` imports it first). The collection then frees the groups, joining their
    threads, while the interpreter is whole. `test_train_layouts` checks every layout's ranks, both
    engines, for gloo threads at exit."""
    if engine is not None:
        engine.close()
    if torch.distributed.is_initialized():
        ds_comm = sys.modules.get("deepspeed.comm.comm")
        if ds_comm is not None and ds_comm.is_initialized():
            ds_comm.destroy_process_group()
        else:
            torch.distributed.destroy_process_group()
    gc.collect()


def clear_method_caches(classes: Iterable[type]) -> None:
    """Empty every `functools.lru_cache` that the methods of `classes` (and their bases) carry.

    A cache put on a method at class level is the class's, keyed by `self`: it keeps every instance it
    has seen, and whatever they hold (parameters, process groups), until interpreter exit, where a
    group freed late can abort the rank (`teardown`). A cache wrapped by another decorator is found
    through the wrapper's `__wrapped__` or its closure. Clearing costs a recomputation at most."""
    seen: set[int] = set()
    for cls in {base for cls in classes for base in cls.__mro__}:
        pending = list(vars(cls).values())
        while pending:
            fn = pending.pop()
            if id(fn) in seen or not callable(fn):
                continue
            seen.add(id(fn))
            if hasattr(fn, "cache_clear"):
                fn.cache_clear()
            pending.append(getattr(fn, "__wrapped__", None))
            for cell in getattr(fn, "__closure__", None) or ():
                try:
                    pending.append(cell.cell_contents)
                except ValueError:  # a cell not yet bound
                    continue
