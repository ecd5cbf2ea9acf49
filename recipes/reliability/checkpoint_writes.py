"""A checkpoint write that fails on one rank fails the save on every rank together, with the path.

An engine's save interleaves file writes with collectives: DeepSpeed's tag check and its closing
barrier, dist_checkpointing's plan exchange and its metadata barrier. A rank that raised at its write
(a full disk, an I/O error, a permission) would leave the others waiting in the next collective until
the process group's timeout (`train.dist_timeout_minutes`, an hour by default), and the one line the
user saw, from torch's C++ writer, was `basic_ios::clear: iostream error`: no file, no rank, no disk.

So while a save runs (`DeferredWrites.active`), `torch.save` (every file DeepSpeed and
dist_checkpointing write through it, and the loop's own per-rank state) and the writes an engine
registers with `guarded_write` do not raise: the first failure is held, with the file it was writing
and the free space of that filesystem (`shutil.disk_usage`), the rank's later writes are skipped (the
save is lost already, and a full disk would fail them too), and the rank goes on through the engine's
collectives. Then every rank exchanges what it holds (`recipes.reliability.checkpoints.CheckpointDirs`,
one all-gather) and all raise `CheckpointSaveFailed` together, naming each failed rank, file, error and
free space; `python -m recipes.train` exits 74 (EX_IOERR).

A write in a process forked during the save (dist_checkpointing's writer processes) raises as usual:
a held failure there would be lost with the process, and dist_checkpointing gathers its writers' errors
and raises them on every rank itself, which the save then holds as a whole.

Parallel contract: holding a failure is local; the exchange is a collective every rank reaches, since no
rank raised in between. An exception raised inside an engine's save by something other than a write
(a collective, a bug) is not held: every rank that raises it reaches the exchange, but a rank that did
not would wait in the engine's next collective (docs/reliability.md, "Not covered").
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch


class CheckpointSaveFailed(RuntimeError):
    """A checkpoint could not be written on some rank; every rank raises it together, and `latest` still
    names the previous checkpoint (`python -m recipes.train` exits 74)."""


@dataclass
class WriteFailure:
    """One rank's failed write: plain strings, so that it crosses ranks in an all-gather."""

    rank: int
    path: str
    error: str
    free: str  # the free space of the path's filesystem, in words

    def describe(self) -> str:
        return f"rank {self.rank} could not write {self.path} ({self.error}; {self.free})"


def free_space(path: str | Path) -> str:
    """'12.3 GiB free of 50.0 GiB on that filesystem' for the nearest existing directory above `path`."""
    where = Path(path)
    while (not where.exists() or where.is_file()) and where != where.parent:
        where = where.parent
    try:
        usage = shutil.disk_usage(where)
    except OSError as err:
        return f"the free space of {where} is unknown ({err.strerror or err})"
    return f"{usage.free / 2**30:.2f} GiB free of {usage.total / 2**30:.2f} GiB on that filesystem ({where})"


def _path_of(args: tuple, kwargs: dict) -> str | None:
    """The file a write call names: its first str / PathLike argument, else a file object's name."""
    values = [*args, *kwargs.values()]
    for value in values:
        if isinstance(value, (str, os.PathLike)):
            return os.fspath(value)
    for value in values:
        name = getattr(value, "name", None)
        if isinstance(name, (str, os.PathLike)):
            return os.fspath(name)
    return None


class DeferredWrites:
    """This rank's write failures during one save (module docstring). Thread-safe: dist_checkpointing
    may write from several threads."""

    def __init__(self, rank: int):
        self.rank, self.pid = rank, os.getpid()
        self.failures: list[WriteFailure] = []
        self._lock = threading.Lock()

    def record(self, path: str | Path | None, err: BaseException, what: str = "a checkpoint file") -> None:
        where = os.fspath(path) if path is not None else what
        error = f"{type(err).__name__}: {err}"
        with self._lock:
            if not self.failures:  # the first is the cause; later ones are its consequences
                self.failures.append(WriteFailure(self.rank, where, error, free_space(where)))

    def guarded(self, write: Callable, what: str = "a checkpoint file") -> Callable:
        """`write`, whose failure is held instead of raised, and which is skipped after one."""

        def guarded_call(*args, **kwargs):
            if os.getpid() != self.pid:  # a forked writer (dist_checkpointing's): its parent collects its errors
                return write(*args, **kwargs)
            if self.failures:
                return None
            try:
                return write(*args, **kwargs)
            except Exception as err:  # noqa: BLE001  (every kind is held and reported by the exchange)
                self.record(_path_of(args, kwargs), err, what)
                return None

        guarded_call.__wrapped__ = write
        return guarded_call

    @contextlib.contextmanager
    def holding(self, path: str | Path, what: str = "a checkpoint file") -> Iterator[None]:
        """A block whose exception is held as a failure at `path` (the engine's save as a whole)."""
        try:
            yield
        except Exception as err:  # noqa: BLE001  (held and reported by the exchange)
            self.record(path, err, what)

    @contextlib.contextmanager
    def active(self) -> Iterator["DeferredWrites"]:
        """`torch.save` and every `guarded_write` hold their failures here for the block's duration."""
        global _ACTIVE
        original, previous = torch.save, _ACTIVE
        torch.save, _ACTIVE = self.guarded(original), self
        try:
            yield self
        finally:
            torch.save, _ACTIVE = original, previous


_ACTIVE: DeferredWrites | None = None


@contextlib.contextmanager
def guarded_write(owner, name: str, what: str | None = None) -> Iterator[None]:
    """For an engine: `owner.name`, a write its save does outside `torch.save` (DeepSpeed's copy of its
    recovery scripts, dist_checkpointing's metadata.json), holds its failure while a save is active;
    a no-op otherwise."""
    writes = _ACTIVE
    if writes is None:
        yield
        return
    original = getattr(owner, name)
    own = name in vars(owner)  # a module's function; for an instance's method, not: drop the wrapper after
    setattr(owner, name, writes.guarded(original, what or name))
    try:
        yield
    finally:
        if own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)
