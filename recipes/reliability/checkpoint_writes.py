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

What a writer raises is held whatever its class, `BaseException` included: torch's distributed checkpoint
(under dist_checkpointing) gathers its writer processes' errors into a `CheckpointException`, which derives
from `BaseException`, so a full disk under a Megatron save would escape an `except Exception` as a traceback
(exit 1). Three kinds are not failures of a write but a request to stop the process, and they propagate as
raised (`STOP_REQUESTS`): `KeyboardInterrupt` (Ctrl-C: the user ends the run, which must not be turned into
a save failure the loop would report and wait on), `SystemExit` (`sys.exit` from a callback: the process is
asked to end with that status) and `GeneratorExit` (a generator being closed). What a failure says names its
cause in words where it can be told (`cause_of`): the disk full (errno ENOSPC anywhere in the exception's
chain, or a short write on a filesystem with less than `NEARLY_FULL` free: torch's writer reports a full disk
as "unexpected pos" with no errno), a quota, a read-only filesystem, a permission, a file-size limit.

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
import errno
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


# Not a failed write but a request to end the process: raised on as they come (module docstring)
STOP_REQUESTS = (KeyboardInterrupt, SystemExit, GeneratorExit)
NEARLY_FULL = 64 * 2**20  # bytes free below which a short write without an errno is taken for a full disk

_CAUSES = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
           errno.EROFS: "the filesystem is read-only", errno.EACCES: "permission denied",
           errno.EPERM: "permission denied", errno.EFBIG: "the file-size limit is reached"}


@dataclass
class WriteFailure:
    """One rank's failed write: plain strings, so that it crosses ranks in an all-gather."""

    rank: int
    path: str
    error: str
    free: str  # the free space of the path's filesystem, in words
    cause: str = ""  # the cause in words where it can be told ("the disk is full"), else ""

    def describe(self) -> str:
        said = f"{self.cause}: " if self.cause else ""
        return f"rank {self.rank} could not write {self.path} ({said}{self.error}; {self.free})"


def _nearest_directory(path: str | Path) -> Path:
    where = Path(path)
    while (not where.exists() or where.is_file()) and where != where.parent:
        where = where.parent
    return where


def _size(n: float) -> str:
    """Bytes in the largest of KiB, MiB, GiB that keeps the figure at 1 or more (bytes below 1 KiB)."""
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            return f"{n:.2f} {unit}"
    raise AssertionError("unreachable")


def free_space(path: str | Path) -> str:
    """'12.30 GiB free of 50.00 GiB on that filesystem (DIR)' for the nearest existing directory above `path`
    (in KiB or MiB where the figure is smaller: a nearly full disk reads as such)."""
    where = _nearest_directory(path)
    try:
        usage = shutil.disk_usage(where)
    except OSError as err:
        return f"the free space of {where} is unknown ({err.strerror or err})"
    return f"{_size(usage.free)} free of {_size(usage.total)} on that filesystem ({where})"


def _rank_errors(err: BaseException) -> list[tuple[int, BaseException]]:
    """A torch distributed `CheckpointException`'s errors, one per rank ({rank: (error, traceback)}); []
    for any other exception."""
    failures = getattr(err, "failures", None)
    if not isinstance(failures, dict):
        return []
    found = []
    for rank, failure in sorted(failures.items()):
        inner = failure[0] if isinstance(failure, tuple) and failure else failure
        if isinstance(inner, BaseException):
            found.append((rank, inner))
    return found


def error_text(err: BaseException) -> str:
    """An exception in one line: its class and message; a `CheckpointException` (whose message is a
    traceback per rank) as the class and message of each rank's own error."""
    ranks = _rank_errors(err)
    if ranks:
        return f"{type(err).__name__} ({'; '.join(f'rank {r}: {error_text(e)}' for r, e in ranks)})"
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _chain(err: BaseException) -> Iterator[BaseException]:
    """The exception, its causes and contexts, and a CheckpointException's per-rank errors."""
    seen, todo = set(), [err]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo += [current.__cause__, current.__context__, *(e for _, e in _rank_errors(current))]


def failure_text(err: BaseException, path: str | Path) -> str:
    """A failed write at `path` in one line: its cause where it can be told, the error, the free space."""
    cause = cause_of(err, path)
    return f"{cause + ': ' if cause else ''}{error_text(err)}; {free_space(path)}"


def cause_of(err: BaseException, path: str | Path) -> str:
    """The cause of a failed write in words ("the disk is full"), or "" where it cannot be told."""
    for current in _chain(err):
        if isinstance(current, OSError) and current.errno in _CAUSES:
            return _CAUSES[current.errno]
        for code, cause in _CAUSES.items():  # an errno quoted in a message (a writer process's error, re-raised)
            if f"[Errno {code}]" in str(current):
                return cause
    if "unexpected pos" in str(err) or "No space left" in str(err):
        try:
            free = shutil.disk_usage(_nearest_directory(path)).free
        except OSError:
            free = None
        if "No space left" in str(err) or (free is not None and free < NEARLY_FULL):
            return "the disk is full"
        return "a write came up short (torch's 'unexpected pos': a full disk, a quota or a file-size limit)"
    return ""


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
        with self._lock:
            if not self.failures:  # the first is the cause; later ones are its consequences
                self.failures.append(WriteFailure(self.rank, where, error_text(err), free_space(where),
                                                  cause_of(err, where)))

    def guarded(self, write: Callable, what: str = "a checkpoint file") -> Callable:
        """`write`, whose failure is held instead of raised, and which is skipped after one."""

        def guarded_call(*args, **kwargs):
            if os.getpid() != self.pid:  # a forked writer (dist_checkpointing's): its parent collects its errors
                return write(*args, **kwargs)
            if self.failures:
                return None
            try:
                return write(*args, **kwargs)
            except STOP_REQUESTS:
                raise
            except BaseException as err:  # noqa: BLE001  (every other kind is held: module docstring)
                self.record(_path_of(args, kwargs), err, what)
                return None

        guarded_call.__wrapped__ = write
        return guarded_call

    @contextlib.contextmanager
    def holding(self, path: str | Path, what: str = "a checkpoint file") -> Iterator[None]:
        """A block whose exception is held as a failure at `path` (the engine's save as a whole)."""
        try:
            yield
        except STOP_REQUESTS:
            raise
        except BaseException as err:  # noqa: BLE001  (every other kind is held: module docstring)
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
