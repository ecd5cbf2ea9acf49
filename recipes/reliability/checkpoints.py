"""A run's checkpoint directories, whichever engine fills them: `<out>/checkpoints/step_XXXXXXXX`, the
`latest` marker, the last `keep_last` kept.

A save is committed by `latest` alone. Every rank writes into a staging directory, `.step_XXXXXXXX.partial`
(emptied first: a failed attempt's files never mix into a new one); after a barrier every file is read
back, fsynced and hashed (the files split over the ranks), rank 0 writes `checkpoint.json` ({file: bytes,
sha256}) and fsyncs it and the directories, renames the staging directory to `step_XXXXXXXX`, and only
then writes, fsyncs and renames `latest` (and fsyncs its directory). So a crash mid-save leaves the
previous checkpoint in charge, and a step directory is either committed or a leftover of a save that
never completed.

A save cut short is not lost. At the first start after a crash (`resume_tag`, before any engine is built),
a staging directory newer than `latest` that holds its checkpoint.json (rank 0 writes it only once every
rank's files are written and hashed: the commit was cut short after it, e.g. torchrun's shutdown timeout
killed a rank during a slow save) is verified like any checkpoint and, intact, committed (renamed to its
step, `latest` written), with a warning. A `latest` that is missing or unreadable (not a step tag) is
rewritten to the newest intact checkpoint (staging or committed, verified), with a warning naming it; an
unreadable one with no intact checkpoint refuses the start (`CheckpointCorrupt`), a missing one with none
starts the run over.

Leftovers never shadow a good checkpoint. Then rank 0 removes, with a warning naming each, every staging
directory and every step directory newer than the checkpoint the run resumes from (a partial directory
of an older version): their steps are trained and saved again. A newer one that is complete (its checkpoint.json: a crash
between the rename and `latest`, or `latest` pointed back by hand) is kept aside as `skipped_<tag>`. Pruning after a save
keeps the `keep_last` newest committed checkpoints (with `checkpoint.json`, at or before the new one)
and removes only directories older than all of them, so the checkpoint just saved and the intact ones
before it are never the ones deleted.

A save that fails on any rank (a full disk, an I/O error, a permission) fails on every rank together
(`recipes.reliability.checkpoint_writes`): one `CheckpointSaveFailed` naming each failed rank, file, error
and the free space of its filesystem; the staging directory is removed, `latest` still names the
previous checkpoint, and `python -m recipes.train` exits 74.

Verified: at resume the checkpoint `latest` names is checked as at save before anything loads it: a
missing, truncated or changed file is reported by name, and the run falls back to the newest older step
directory that is complete and intact, with a warning (the corrupt ones are renamed `corrupt_<tag>` and
`latest` rewritten; a step directory `latest` names that is gone is said to be missing in that one line); with `train.resume_fallback: false` it refuses instead and says how to fall back.
Checkpoints saved before verification (no `checkpoint.json`) load unchecked when `latest` names them.
The per-rank state files hold plain data and are read with `torch.load(weights_only=True)`: a file
planted in a shared run directory cannot run code at resume.

The engine writes its own state (model, optimizer, schedule) into the step directory; beside it each
rank saves the data reader's position and its RNG state (`rank_XXXXX.pt`), and rank 0 the layout
(`layout.json`) that the engine compares at resume and the recipe (`recipe.json`) that the resume policy
compares (`recipes.reliability.resume_policy`). The reader's position is a count of samples of one global
order, so it does not depend on the layout; ranks without a file of their own (more ranks than saved)
take rank 0's (the same position, and rank 0's RNG state).
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

from .checkpoint_writes import CheckpointSaveFailed, DeferredWrites, WriteFailure, free_space
from recipes.training.runtime import Runtime

LATEST = "latest"
MANIFEST = "checkpoint.json"
RECIPE = "recipe.json"
STEP_DIR = re.compile(r"step_(\d{8,})")
STAGING = re.compile(r"\.step_(\d{8,})\.partial")

__all__ = ["CheckpointCorrupt", "CheckpointDirs", "CheckpointSaveFailed", "step_tag"]


class CheckpointCorrupt(RuntimeError):
    """No intact checkpoint to resume from (or the fallback policy refused one)."""


def step_tag(step: int) -> str:
    return f"step_{step:08d}"


def tag_step(tag: str) -> int:
    return int(tag.split("_")[1])


def read_latest(root: Path) -> tuple[str | None, str | None]:
    """`root/latest` as a step tag, and why it cannot be read as one (both None: there is no `latest`)."""
    marker = root / LATEST
    try:
        text = marker.read_text().strip() if marker.is_file() else None
    except (OSError, UnicodeDecodeError) as err:
        return None, f"{marker} is unreadable ({type(err).__name__}: {err})"
    if text is not None and not STEP_DIR.fullmatch(text):
        return None, f"{marker} holds {text[:40]!r}, not a checkpoint's name"
    return text, None


class CheckpointDirs:
    """The step directories of one run. Every method is called on every rank (they hold collectives).
    `recipe`: the run's recipe as a dict, saved in every checkpoint as `recipe.json`."""

    def __init__(self, root: Path, keep_last: int, runtime: Runtime, fallback: bool = True,
                 recipe: dict | None = None):
        self.root, self.keep_last, self.runtime, self.fallback = Path(root), keep_last, runtime, fallback
        self.recipe = recipe
        self._checked = False
        self._verified: str | None = None  # a checkpoint `_recover` verified already

    def latest_tag(self) -> str | None:
        marker = self.root / LATEST
        return marker.read_text().strip() if marker.is_file() else None

    def _latest_problem(self) -> str | None:
        """Why `latest` cannot be read as a step tag (None: it can, or there is none)."""
        return read_latest(self.root)[1]

    def resume_tag(self) -> str | None:
        """The checkpoint to resume from: `latest` once verified (the first call checks it and removes
        the leftovers of unfinished saves, a collective), or the newest intact older one after a warning
        (see the module docstring)."""
        if not self._checked:
            self._recover()
            self._select()
            self._remove_unfinished(self.latest_tag())
            self._checked = True
        return self.latest_tag()

    def _recover(self) -> None:
        """Before `latest` is verified: commit a verified staging directory newer than `latest` (a save cut
        short between its checkpoint.json and `latest`, e.g. a rank killed by torchrun's shutdown timeout),
        and when `latest` is missing or unreadable, point it at the newest intact checkpoint; each said in a
        warning. A collective (the candidates are hashed by every rank)."""
        found = [None]
        if self.runtime.is_main and self.root.is_dir():
            problem = self._latest_problem()
            latest = None if problem else self.latest_tag()
            after = tag_step(latest) if latest else -1
            candidates = []
            for path in self.root.iterdir():
                staged, committed = STAGING.fullmatch(path.name), STEP_DIR.fullmatch(path.name)
                if not (path / MANIFEST).is_file() or not (staged or committed):
                    continue
                step = int((staged or committed).group(1))
                if (staged and step > after) or (committed and latest is None):
                    candidates.append((step, bool(staged), path.name))
            found = [(latest, problem, [name for *_, name in sorted(candidates, reverse=True)])]
        dist.broadcast_object_list(found, src=0)
        if found[0] is None:
            return
        latest, problem, candidates = found[0]
        why = problem or (f"{self.root / LATEST} is missing" if latest is None else "")
        for name in candidates:
            problems = self._problems(name)
            if problems:
                if self.runtime.is_main:
                    print(f"[numloss] warning: {self.root / name} was not resumed from: " + "; ".join(problems[:3]),
                          file=sys.stderr, flush=True)
                continue
            if self.runtime.is_main:
                self._commit_recovered(name, why)
            self._verified = name.removeprefix(".").removesuffix(".partial")
            dist.barrier()
            return
        if problem:
            raise CheckpointCorrupt(f"{problem}, and no checkpoint in {self.root} is intact: remove {self.root} to "
                                    f"start over")

    def _commit_recovered(self, name: str, why: str) -> None:
        """Rank 0: make the intact `name` (a staging or a step directory) the checkpoint `latest` names."""
        tag = name.removeprefix(".").removesuffix(".partial")
        if name != tag:
            target = self.root / tag
            if target.exists():  # an unfinished directory of the same step: the staging one is the verified save
                shutil.rmtree(target)
            os.replace(self.root / name, target)
            fsync_path(self.root)
            said = (f"{self.root / name} holds a verified checkpoint whose commit was cut short (its checkpoint.json "
                    f"is there, `latest` was not written): committed as {tag}")
        else:
            said = f"{why}: resuming from {tag}, the newest intact checkpoint"
        _atomic_write(self.root / LATEST, tag)
        fsync_path(self.root)
        print(f"[numloss] warning: {said}", file=sys.stderr, flush=True)

    def manifest_sha256(self, tag: str | None) -> str | None:
        """The sha256 of a checkpoint's checkpoint.json (None: no such checkpoint, or one saved before
        verification): it names that save, where the step tag is shared with a later save of the same step."""
        path = self.root / tag / MANIFEST if tag else None
        return sha256_file(path) if path is not None and path.is_file() else None

    def saved_layout(self) -> dict | None:
        """The layout the latest checkpoint was saved with (None: no checkpoint, or none recorded)."""
        return self._saved_json("layout.json")

    def saved_recipe(self) -> dict | None:
        """The recipe the latest checkpoint was trained with (None: no checkpoint, or one saved before
        checkpoints recorded it)."""
        return self._saved_json(RECIPE)

    def _saved_json(self, name: str) -> dict | None:
        tag = self.resume_tag()
        path = self.root / tag / name if tag else None
        return json.loads(path.read_text()) if path is not None and path.is_file() else None

    # ---- saving --------------------------------------------------------------------------------------

    def save(self, step: int, dataset: ShardDataset, save_state: Callable[[Path], None], layout: dict) -> Path:
        """`save_state(directory)` writes the engine's state (every rank, collectively); then this rank's
        reader position and RNG, rank 0's `layout.json` and `recipe.json`, the verification, and the
        commit (module docstring). Raises `CheckpointSaveFailed` on every rank together."""
        tag = step_tag(step)
        final, staging = self.root / tag, self.root / f".{tag}.partial"
        writes = DeferredWrites(self.runtime.rank)
        if self.runtime.is_main:
            with writes.holding(staging, "the staging directory"):
                for stale in (staging, final, self.root / f"{tag}_universal"):  # a failed attempt's files
                    if stale.exists() and stale.name != self.latest_tag():
                        shutil.rmtree(stale)
                staging.mkdir(parents=True)
        self._agree(step, writes.failures, staging, final)
        with writes.active():  # from here a failed write is held until the next exchange
            with writes.holding(staging, "the engine's checkpoint state"):
                save_state(staging)
            torch.save({"step": step, "data": dataset.state_dict(), "rng": torch.get_rng_state(),
                        "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None},
                       staging / f"rank_{self.runtime.rank:05d}.pt")
            if self.runtime.is_main:
                write_text = writes.guarded(Path.write_text)
                write_text(staging / "layout.json", json.dumps(layout))
                if self.recipe is not None:
                    write_text(staging / RECIPE, json.dumps(self.recipe, indent=1))
        self._agree(step, writes.failures, staging, final)  # every rank's files are complete, or none commits
        files = self._hash_share(staging, self._file_list(staging), fsync=True)
        unreadable = [WriteFailure(entry["rank"], str(staging / name), entry["error"], free_space(staging))
                      for name, entry in sorted(files.items()) if "error" in entry]
        if self.runtime.is_main and not unreadable:
            with writes.holding(staging, "the checkpoint's commit"):
                self._commit(step, files, staging, final)
            if not writes.failures:
                self._prune(step)
        self._agree(step, unreadable + writes.failures, staging, final)
        return final

    def _commit(self, step: int, files: dict, staging: Path, final: Path) -> None:
        """Rank 0: checkpoint.json, fsyncs, the staging directory renamed to its step, then `latest`."""
        _atomic_write(staging / MANIFEST, json.dumps({"step": step, "files": files}, indent=1, sort_keys=True))
        for sub in sorted({staging / Path(f).parent for f in files} | {staging}):
            fsync_path(sub)
        os.replace(staging, final)
        fsync_path(self.root)
        _atomic_write(self.root / LATEST, final.name)
        fsync_path(self.root)

    def _agree(self, step: int, failures: list[WriteFailure], staging: Path, final: Path) -> None:
        """Every rank's failures (one all-gather); if any, rank 0 removes what the save left that
        `latest` does not name, and every rank raises CheckpointSaveFailed with the same message."""
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, failures)
        found = sorted({(f.rank, f.path): f for part in everyone for f in part}.values(), key=lambda f: f.rank)
        if not found:
            return
        note = [""]
        if self.runtime.is_main:
            note = [self._discard(staging, final)]
        dist.broadcast_object_list(note, src=0)
        latest = self.latest_tag()
        kept = (f"`latest` names {latest}: run the same command to resume from step {tag_step(latest)}" if latest
                else "This run has no checkpoint yet: the same command starts it over")
        raise CheckpointSaveFailed(f"checkpoint step {step} was not saved: " + "; ".join(f.describe() for f in found)
                                   + f". {note[0]}{kept} (after freeing space or fixing the path)")

    def _discard(self, staging: Path, final: Path) -> str:
        """Rank 0, after a failed save: remove its staging directory (and its step directory when the
        rename happened but `latest` does not name it). Returns what the message says about them."""
        problems: list[str] = []
        written = [path for path in (staging, final)
                   if path.exists() and not (path == final and self.latest_tag() == final.name)]
        for path in written:
            shutil.rmtree(path, onerror=lambda _f, p, info: problems.append(f"{p}: {info[1]}"))
        if problems:
            return f"What it wrote could not all be removed ({'; '.join(problems[:3])}): remove {staging} by hand. "
        if not written:  # refused before its directory existed (a read-only or full filesystem)
            return "Nothing of it was written. "
        return f"What it wrote ({staging}) was removed. "

    def _prune(self, newest: int) -> None:
        """Rank 0, after a commit: keep the `keep_last` newest committed checkpoints up to `newest`;
        remove the step directories older than all of them (module docstring). A directory that cannot be
        removed is a warning: the new checkpoint is committed."""
        steps = self._step_dirs()
        committed = [s for s, path in steps.items() if s <= newest and (path / MANIFEST).is_file()]
        kept = sorted(committed)[-self.keep_last:]
        problems: list[str] = []
        for s, path in steps.items():
            if s < kept[0]:
                for old in (path, self.root / f"{path.name}_universal"):
                    if old.exists():
                        shutil.rmtree(old, onerror=lambda _f, p, info: problems.append(f"{p}: {info[1]}"))
        if problems:
            print(f"[numloss] warning: old checkpoints could not all be removed (keep_last {self.keep_last}): "
                  + "; ".join(problems[:3]), file=sys.stderr, flush=True)

    def _step_dirs(self) -> dict[int, Path]:
        if not self.root.is_dir():
            return {}
        return {int(m.group(1)): p for p in self.root.iterdir() if p.is_dir() and (m := STEP_DIR.fullmatch(p.name))}

    def _remove_unfinished(self, resume: str | None) -> None:
        """Rank 0 clears what saves that never completed left (module docstring); a collective. A step
        directory newer than the resume checkpoint that has its checkpoint.json (complete, but `latest`
        never named it, or was pointed back by hand) is renamed `skipped_<tag>` rather than removed."""
        if self.runtime.is_main and self.root.is_dir():
            after = tag_step(resume) if resume else -1
            for path in sorted(self.root.iterdir()):
                step_dir = STEP_DIR.fullmatch(path.name.removesuffix("_universal"))
                if STAGING.fullmatch(path.name):
                    why = "the staging directory of a save that never completed"
                elif step_dir and path.is_dir() and int(step_dir.group(1)) > after:
                    why = (f"newer than {resume}, the checkpoint this run resumes from" if resume
                           else "this run has no checkpoint to resume from (no `latest`)")
                else:
                    continue
                if (path / MANIFEST).is_file():
                    aside = _free_name(self.root / f"skipped_{path.name}")
                    os.replace(path, aside)
                    print(f"[numloss] warning: {path} is complete but {why}: kept as {aside}, not resumed from; "
                          f"its steps are trained and saved again", file=sys.stderr, flush=True)
                    continue
                problems: list[str] = []
                shutil.rmtree(path, onerror=lambda _f, p, info: problems.append(f"{p}: {info[1]}"))
                print(f"[numloss] warning: removed {path}: {why}, and its save never completed; its steps are "
                      f"trained and saved again" + (f" (not all of it could be removed: {'; '.join(problems[:3])})"
                                                    if problems else ""), file=sys.stderr, flush=True)
        dist.barrier()

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
        return int(state["step"]) if "step" in state else tag_step(tag)

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
        """{file: {"bytes", "sha256"}} of every file ({"error", "rank"}: unreadable), each rank reading every
        world-th one; a collective."""
        world, rank = dist.get_world_size(), self.runtime.rank
        mine = {}
        for name in names[rank::world]:
            path = directory / name
            try:
                mine[name] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
                if fsync:
                    fsync_path(path)
            except OSError as err:
                mine[name] = {"error": f"{type(err).__name__}: {err.strerror or err}", "rank": rank}
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
        if tag is None or tag == self._verified:
            return
        problems = self._problems(tag)
        if not problems:
            return
        older = sorted((p.name for p in self.root.iterdir() if p.is_dir() and STEP_DIR.fullmatch(p.name)
                        and tag_step(p.name) < tag_step(tag) and (p / MANIFEST).is_file()),
                       key=tag_step, reverse=True)
        if not (self.root / tag).is_dir():
            report = f"{self.root / LATEST} names {tag}, but {self.root / tag} is missing"
        else:
            report = f"checkpoint {self.root / tag} is corrupt: " + "; ".join(problems[:5]) + (
                f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
        corrupt = [tag]
        for candidate in older:
            if self._problems(candidate):
                corrupt.append(candidate)
                continue
            if not self.fallback:
                raise CheckpointCorrupt(f"{report}. train.resume_fallback is false: to resume from the newest intact "
                                        f"one, {candidate}, run: echo {candidate} > {self.root / LATEST}")
            if self.runtime.is_main:
                aside = [self._set_aside(bad) for bad in corrupt]
                _atomic_write(self.root / LATEST, candidate)
                fsync_path(self.root)
                print(f"[numloss] warning: {report}. Resuming from {candidate}, the newest intact checkpoint "
                      f"({'; '.join(aside)})", file=sys.stderr, flush=True)
            dist.barrier()
            return
        raise CheckpointCorrupt(f"{report}; no older checkpoint is intact either. Remove {self.root} to start over")

    def _set_aside(self, tag: str) -> str:
        """Rank 0: a corrupt checkpoint renamed `corrupt_<tag>` (kept for a look), its conversion removed;
        what became of it, in words. A step directory that is missing (`latest` names a directory removed
        by hand or by a cleanup) has nothing to set aside."""
        shutil.rmtree(self.root / f"{tag}_universal", ignore_errors=True)  # derived data, rebuilt from a good one
        if not (self.root / tag).exists():
            return f"{tag} is missing"
        aside = _free_name(self.root / f"corrupt_{tag}")
        os.replace(self.root / tag, aside)
        return f"{tag} is kept as {aside}"


def _free_name(path: Path) -> Path:
    """`path`, or `path.1`, `path.2`, ...: the first that does not exist (a directory set aside twice)."""
    candidate, n = path, 1
    while candidate.exists():
        candidate, n = path.with_name(f"{path.name}.{n}"), n + 1
    return candidate


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
