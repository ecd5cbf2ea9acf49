"""A run's checkpoint directories, whichever engine fills them: `<out>/checkpoints/step_XXXXXXXX`, the
`latest` marker, the last `keep_last` kept.

Restarts: `latest` is written only after every rank has finished its part of the save (a barrier, then
an atomic rename), so a crash mid-save leaves the previous checkpoint in charge.

Verified: after that barrier every file of the step directory is read back, fsynced and hashed (the
files split over the ranks), and rank 0 writes `checkpoint.json` ({file: bytes, sha256}), fsyncs it and
the directories, and only then writes, fsyncs and renames `latest` (and fsyncs its directory). At
resume the checkpoint `latest` names is checked the same way before anything loads it: a missing,
truncated or changed file is reported by name, and the run falls back to the newest older step
directory that is complete and intact, with a warning (the corrupt one is renamed `corrupt_<tag>` and
`latest` rewritten); with `train.resume_fallback: false` it refuses instead and says how to fall back.
Checkpoints saved before this (no `checkpoint.json`) load unchecked. The per-rank state files hold
plain data and are read with `torch.load(weights_only=True)`: a file planted in a shared run directory
cannot run code at resume. The engine writes its
own state (model, optimizer, schedule) into the step directory; beside it each rank saves the data
reader's position and its RNG state (`rank_XXXXX.pt`), and rank 0 the layout (`layout.json`) that the
engine compares at resume. The reader's position is a count of samples of one global order, so it does
not depend on the layout; ranks without a file of their own (more ranks than saved) take rank 0's
(the same position, and rank 0's RNG state).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from data_prep.reader import ShardDataset
from data_prep.shards import sha256_file

from .runtime import Runtime

LATEST = "latest"
MANIFEST = "checkpoint.json"
STEP_DIR = re.compile(r"step_\d{8}")


class CheckpointCorrupt(RuntimeError):
    """No intact checkpoint to resume from (or the fallback policy refused one)."""


def step_tag(step: int) -> str:
    return f"step_{step:08d}"


class CheckpointDirs:
    """The step directories of one run. Every method is called on every rank (they hold barriers)."""

    def __init__(self, root: Path, keep_last: int, runtime: Runtime, fallback: bool = True):
        self.root, self.keep_last, self.runtime, self.fallback = Path(root), keep_last, runtime, fallback
        self._checked = False

    def latest_tag(self) -> str | None:
        marker = self.root / LATEST
        return marker.read_text().strip() if marker.is_file() else None

    def resume_tag(self) -> str | None:
        """The checkpoint to resume from: `latest` once verified (the first call checks it, a collective),
        or the newest intact older one after a warning (see the module docstring)."""
        if not self._checked:
            self._select()
            self._checked = True
        return self.latest_tag()

    def saved_layout(self) -> dict | None:
        """The layout the latest checkpoint was saved with (None: no checkpoint, or none recorded)."""
        tag = self.resume_tag()
        path = self.root / tag / "layout.json" if tag else None
        return json.loads(path.read_text()) if path is not None and path.is_file() else None

    def save(self, step: int, dataset: ShardDataset, save_state: Callable[[Path], None], layout: dict) -> Path:
        """`save_state(directory)` writes the engine's state (every rank, collectively); then this rank's
        reader position and RNG, rank 0's `layout.json`, and `latest` once every rank is done."""
        tag = step_tag(step)
        directory = self.root / tag
        if self.runtime.is_main:
            directory.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        save_state(directory)
        torch.save({"step": step, "data": dataset.state_dict(), "rng": torch.get_rng_state(),
                    "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None},
                   directory / f"rank_{self.runtime.rank:05d}.pt")
        if self.runtime.is_main:
            (directory / "layout.json").write_text(json.dumps(layout))
        dist.barrier()  # every rank's files are complete before they are hashed and `latest` moves
        files = self._hash_share(directory, self._file_list(directory), fsync=True)
        if self.runtime.is_main:
            _atomic_write(directory / MANIFEST, json.dumps({"step": step, "files": files}, indent=1, sort_keys=True))
            for sub in sorted({directory / Path(f).parent for f in files} | {directory}):
                fsync_path(sub)
            _atomic_write(self.root / LATEST, tag)
            fsync_path(self.root)
            tags = sorted(p.name for p in self.root.iterdir() if p.is_dir() and STEP_DIR.fullmatch(p.name))
            for old in tags[:-self.keep_last]:
                shutil.rmtree(self.root / old, ignore_errors=True)
                shutil.rmtree(self.root / f"{old}_universal", ignore_errors=True)
        dist.barrier()
        return directory

    def load(self, dataset: ShardDataset, load_state: Callable[[Path], None]) -> int:
        """Restore the latest checkpoint: `load_state(directory)` (the engine's state, every rank), then
        the reader position and RNG; returns the step it was saved at (0: none)."""
        tag = self.resume_tag()
        if tag is None:
            return 0
        directory = self.root / tag
        load_state(directory)
        own = directory / f"rank_{self.runtime.rank:05d}.pt"
        # plain data (the reader's position, RNG states): never unpickle code from a shared directory
        state = torch.load(own if own.is_file() else directory / "rank_00000.pt", weights_only=True)
        dataset.load_state_dict(state["data"])
        torch.set_rng_state(state["rng"])
        if state["cuda_rng"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda_rng"])
        return int(state["step"]) if "step" in state else int(tag.split("_")[1])

    # ---- verification ------------------------------------------------------------------------------

    def _file_list(self, directory: Path) -> list[str]:
        """Every file of a step directory (relative, sorted), as rank 0 sees it, on every rank."""
        names = [None]
        if self.runtime.is_main:
            names = [sorted(str(p.relative_to(directory)) for p in directory.rglob("*")
                            if p.is_file() and p.name != MANIFEST)]
        dist.broadcast_object_list(names, src=0)
        return names[0]

    def _hash_share(self, directory: Path, names: list[str], fsync: bool = False) -> dict[str, dict]:
        """{file: {"bytes", "sha256"}} of every file, each rank reading every world-th one; a collective."""
        world, rank = dist.get_world_size(), self.runtime.rank
        mine = {}
        for name in names[rank::world]:
            path = directory / name
            try:
                mine[name] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
                if fsync:
                    fsync_path(path)
            except OSError as err:
                mine[name] = {"error": f"{type(err).__name__}: {err.strerror or err}"}
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine)
        return {k: v for part in everyone for k, v in part.items()}

    def _problems(self, tag: str) -> list[str] | None:
        """What is wrong with a step directory's files against its checkpoint.json ([] intact, None: no
        checkpoint.json, a checkpoint from before verification). A collective."""
        directory = self.root / tag
        if not directory.is_dir():
            return [f"{directory}: missing"]
        manifest = [None]
        if self.runtime.is_main and (directory / MANIFEST).is_file():
            try:
                manifest = [json.loads((directory / MANIFEST).read_text())["files"]]
            except (OSError, ValueError, KeyError) as err:
                manifest = [{"error": str(err)}]
        dist.broadcast_object_list(manifest, src=0)
        recorded = manifest[0]
        if recorded is None:
            return None
        if "error" in recorded:
            return [f"{directory / MANIFEST}: unreadable ({recorded['error']})"]
        found = self._hash_share(directory, sorted(recorded))
        problems = []
        for name, want in sorted(recorded.items()):
            got = found[name]
            if "error" in got:
                problems.append(f"{directory / name}: {'missing' if 'FileNotFound' in got['error'] else got['error']}")
            elif got["bytes"] != want["bytes"]:
                problems.append(f"{directory / name}: {got['bytes']} bytes, {want['bytes']} when saved (truncated?)")
            elif got["sha256"] != want["sha256"]:
                problems.append(f"{directory / name}: its contents changed since it was saved (sha256 differs)")
        return problems

    def _select(self) -> None:
        """Verify `latest`; fall back to the newest intact older checkpoint, or refuse (see the docstring)."""
        tag = self.latest_tag()
        if tag is None:
            return
        problems = self._problems(tag)
        if not problems:
            return
        older = sorted((p.name for p in self.root.iterdir() if p.is_dir() and STEP_DIR.fullmatch(p.name)
                        and p.name < tag and (p / MANIFEST).is_file()), reverse=True)
        report = f"checkpoint {self.root / tag} is corrupt: " + "; ".join(problems[:5]) + (
            f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
        for candidate in older:
            if self._problems(candidate):
                continue
            if not self.fallback:
                raise CheckpointCorrupt(f"{report}. train.resume_fallback is false: to resume from the newest intact "
                                        f"one, {candidate}, run: echo {candidate} > {self.root / LATEST}")
            if self.runtime.is_main:
                os.replace(self.root / tag, self.root / f"corrupt_{tag}")
                shutil.rmtree(self.root / f"{tag}_universal", ignore_errors=True)
                _atomic_write(self.root / LATEST, candidate)
                fsync_path(self.root)
                print(f"[numloss] warning: {report}. Resuming from {candidate}, the newest intact checkpoint; "
                      f"the corrupt one is kept as {self.root / f'corrupt_{tag}'}", file=sys.stderr, flush=True)
            dist.barrier()
            return
        raise CheckpointCorrupt(f"{report}; no older checkpoint is intact either. Remove {self.root} to start over")


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a rename is durable once its directory is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, text: str) -> None:
    """`text` into `path` through a fsynced temporary file and a rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
