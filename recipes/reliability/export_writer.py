"""The Hugging Face export of a run (`final/`): the one writer both engines call; the engines only gather
their weights and convert them to Hugging Face names (`recipes.engines.*.export`).

What a finished export is: safetensors shards (`model.safetensors`, or `model-0000i-of-0000N.safetensors`
with `model.safetensors.index.json`: transformers' own layout), `config.json`, `generation_config.json`
where the model generates, the tokenizer or processor, any engine extra (LoRA's `adapter/`), and last
`numloss_export.json`, the record of what it holds: the step, the checkpoint it came from, the sha256 of
the recipe it was trained with, the engine. A run is finished only when `final/` records its last step
(`recipes.reliability.resume_policy`).

How it is written (`write_export`, a collective every rank calls):
1. rank 0 empties the staging directory `.final.partial` beside `final/`; every rank learns whether it
   could (an all-gather of the ranks' errors, so no rank waits in a barrier for a failed one);
2. each rank writes its shards into it under names of its own (`write_shard`: safetensors, then fsync);
3. one all-gather of every rank's shards and error; then rank 0 alone numbers the shards, writes the
   index (the one place export indexes are written), the configs, the tokenizer and the record into the
   staging directory, gives every file the default mode (`recipes.training.file_modes`), fsyncs every
   file and directory, and switches it in: one atomic exchange with `final/` where the file system has
   it (Linux renameat2 RENAME_EXCHANGE), else two renames; the previous export is removed after, and the
   parent directory fsynced;
4. rank 0 broadcasts the outcome: every rank returns, or every rank raises the same `ExportWriteFailed`
   naming each failed rank, the cause where it can be told (a full disk), its error and the free space of
   the filesystem it wrote to, and the previous `final/` is as it was (`python -m recipes.train` exits 74,
   as for a checkpoint; the next start writes the export again from the same checkpoint). What a writer
   raises is caught whatever its class but a stop request (`checkpoint_writes.STOP_REQUESTS`).

A process killed anywhere in this leaves `final/` whole, old or new (with the exchange; with two renames a
kill between them leaves `final/` missing and the old export in `.final.old`), and leftovers beside it:
`clean_leftovers`, at the next start, puts `.final.old` back when `final/` is missing and removes the rest,
so that start finds the old export and writes the new one.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from recipes.training.file_modes import give_default_mode

from .checkpoint_writes import STOP_REQUESTS, failure_text
from .checkpoints import CheckpointDirs, fsync_path

INDEX = "model.safetensors.index.json"
RECORD = "numloss_export.json"
SINGLE = "model.safetensors"


class ExportWriteFailed(RuntimeError):
    """The export could not be written on some rank (every rank raises it together); the previous export,
    if any, is as it was (`python -m recipes.train` exits 74)."""


@dataclass(frozen=True)
class ExportRecord:
    """What an export holds: the model of optimizer step `step`, exported from checkpoint `checkpoint` (a
    step tag; `checkpoint_sha256`: the sha256 of its checkpoint.json, which tells a checkpoint from a later
    one of the same step trained again), trained with the recipe whose canonical JSON has sha256
    `recipe_sha256`, by `engine`."""

    step: int
    checkpoint: str | None
    checkpoint_sha256: str | None
    recipe_sha256: str
    engine: str

    def describe(self) -> str:
        return f"step {self.step} (from checkpoint {self.checkpoint})"

    def holds(self, step: int, checkpoint: str | None, checkpoint_sha256: str | None) -> bool:
        """Whether this is the export of that checkpoint (its sha256 compared where both are known)."""
        if self.step != step or self.checkpoint != checkpoint:
            return False
        return None in (self.checkpoint_sha256, checkpoint_sha256) or self.checkpoint_sha256 == checkpoint_sha256


def recipe_sha256(recipe: dict) -> str:
    """The sha256 of a recipe's canonical JSON (sorted keys): equal recipes, equal hashes."""
    return hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()


def export_record(dirs: CheckpointDirs, step: int, recipe: dict, engine: str) -> ExportRecord:
    """The record of an export of `dirs`'s latest checkpoint, at `step`, of `recipe` (a dict)."""
    tag = dirs.latest_tag()
    return ExportRecord(step, tag, dirs.manifest_sha256(tag), recipe_sha256(recipe), engine)


def read_record(path: str | Path) -> ExportRecord | None:
    """The record of the export at `path`; None when there is none (no export, an unfinished one, one
    written before exports recorded themselves) or it cannot be read."""
    try:
        data = json.loads((Path(path) / RECORD).read_text())
        return ExportRecord(int(data["step"]), data.get("checkpoint"), data.get("checkpoint_sha256"),
                            str(data["recipe_sha256"]), str(data["engine"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def staging_dir(path: Path) -> Path:
    """Where an export is written before it is switched in: beside `path`, hidden."""
    return path.parent / f".{path.name}.partial"


def old_dir(path: Path) -> Path:
    """Where the previous export waits between the two renames of a switch without an exchange."""
    return path.parent / f".{path.name}.old"


def _leftovers(path: Path) -> list[Path]:
    # the last two: the names an older Megatron writer used
    return [staging_dir(path), old_dir(path), path.parent / f".{path.name}.tmp-export",
            path.parent / f".{path.name}.old-export"]


def clean_leftovers(path: str | Path) -> list[str]:
    """Rank 0, at a start, before anything reads `path`: what an interrupted export left beside it (module
    docstring). Returns one line per thing done, for the log."""
    path = Path(path)
    said = []
    if not path.exists():
        for previous in (old_dir(path), path.parent / f".{path.name}.old-export"):
            if previous.is_dir():
                os.replace(previous, path)
                fsync_path(path.parent)
                said.append(f"{path} was missing (an export was interrupted while switching it in): the previous "
                            f"export, {previous}, is back in its place")
                break
    for leftover in _leftovers(path):
        if leftover.exists():
            shutil.rmtree(leftover, ignore_errors=True)
            said.append(f"removed {leftover}, left by an export that was interrupted")
    return said


@dataclass
class Shard:
    """One safetensors file a rank wrote into the staging directory: its name there, the tensors' keys and
    their bytes. Shards are numbered in the order of their names."""

    file: str
    keys: list[str]
    bytes: int


def write_shard(directory: Path, name: str, tensors: dict[str, torch.Tensor]) -> Shard:
    """`tensors` (contiguous, on the CPU) as the safetensors file `directory/name`, fsynced."""
    from safetensors.torch import save_file

    save_file(tensors, str(directory / name), metadata={"format": "pt"})
    fsync_path(directory / name)
    return Shard(name, sorted(tensors), sum(t.numel() * t.element_size() for t in tensors.values()))


class ShardWriter:
    """Accumulates tensors on one rank and writes a shard (`<prefix>-<k>.safetensors`) whenever the next
    tensor would take it past `max_bytes`; `flush` writes the rest."""

    def __init__(self, directory: Path, prefix: str, max_bytes: int):
        self.directory, self.prefix, self.max_bytes = directory, prefix, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[Shard] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending[name] = tensor.detach().to("cpu").contiguous()
        self.pending_bytes += size

    def flush(self) -> None:
        if not self.pending:
            return
        self.shards.append(write_shard(self.directory, f"{self.prefix}-{len(self.shards):05d}.safetensors",
                                       self.pending))
        self.pending, self.pending_bytes = {}, 0


def agree(step: str, error: BaseException | str | None, what: str = "export", where: str | Path | None = None,
          raises: type[Exception] = RuntimeError) -> None:
    """Collective: raise `raises` on every rank if `step` of `what` failed on any (each rank gives its own
    error or None); the message names each failed rank and its error (with `where`, the directory it wrote
    to: the cause and the free space there)."""
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, _said(error, where))
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
    if failed:
        raise raises(f"{what}: {step} failed on {len(failed)} rank(s); {'; '.join(failed)}") from (
            error if isinstance(error, Exception) else None)


def _said(error: BaseException | str | None, where: str | Path | None = None) -> str | None:
    if error is None or isinstance(error, str):
        return error
    return failure_text(error, where) if where is not None else f"{type(error).__name__}: {error}"


@dataclass
class HFFiles:
    """What rank 0 writes beside the weights: the model's config (None: no weights in this export, e.g. a
    LoRA adapter alone), its generation config (None: the model does not generate or has none), the
    tokenizer or processor (None: none)."""

    config: object = None
    generation_config: object = None
    tokenizer: object = None


def write_export(path: str | Path, write_shards: Callable[[Path], list[Shard]], files: HFFiles,
                 record: ExportRecord | None, *, what: str = "export") -> list[Shard]:
    """Write the export at `path` (module docstring). A collective over the default group: every rank calls
    it. `write_shards(staging)`: this rank's part, called on every rank with the staging directory; it
    writes its shards there (`write_shard`, `ShardWriter`) and any engine extra (a rank that fails must
    still take part in every collective the callback makes, then raise). `record`: what `final/` will say
    it holds (None: no record, for tools that export outside a run). Returns this rank's shards under their
    final names."""
    path = Path(path)
    staging = staging_dir(path)
    rank, world = dist.get_rank(), dist.get_world_size()
    error = None
    if rank == 0:
        try:
            for line in clean_leftovers(path):
                print(f"[numloss] {line}", file=sys.stderr, flush=True)
            staging.mkdir(parents=True)
        except STOP_REQUESTS:
            raise
        except BaseException as err:  # noqa: BLE001  (every rank must learn of it, or the others wait forever)
            error = err
    # it exists before anyone writes into it
    agree("preparing the directory", error, f"export to {path}", where=staging, raises=ExportWriteFailed)

    shards: list[Shard] = []
    error = None
    try:
        shards = list(write_shards(staging))
    except STOP_REQUESTS:
        raise
    except BaseException as err:  # noqa: BLE001  (every rank must learn of it, or the others wait forever)
        error = err
    everyone: list = [None] * world
    dist.all_gather_object(everyone, ([asdict(s) for s in shards], _said(error, staging)))  # every shard is on disk
    failed = [f"rank {r}: {e}" for r, (_, e) in enumerate(everyone) if e is not None]
    step = "writing the shards"
    names: dict[str, str] = {}
    if not failed and rank == 0:
        try:
            names = _assemble([[Shard(**s) for s in part] for part, _ in everyone], staging, path, files, record)
        except STOP_REQUESTS:
            raise
        except BaseException as err:  # noqa: BLE001
            step = "assembling the export"
            failed = [f"rank 0: {_said(err, staging)}"]
    verdict = [(step, failed, names)]
    dist.broadcast_object_list(verdict, src=0)  # rank 0 has switched `path` in, or not
    step, failed, names = verdict[0]
    if failed:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        kept = f"the previous {path} is unchanged" if path.is_dir() else f"no {path} was written"
        raise ExportWriteFailed(f"{what} to {path}: {step} failed on {len(failed)} rank(s); {'; '.join(failed)} "
                                f"({kept}; {staging} removed)")
    return [Shard(names[s.file], s.keys, s.bytes) for s in shards]


def shard_names(count: int) -> list[str]:
    """transformers' names for `count` shards."""
    return [SINGLE] if count == 1 else [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _assemble(parts: list[list[Shard]], staging: Path, path: Path, files: HFFiles,
              record: ExportRecord | None) -> dict[str, str]:
    """Rank 0, once every shard is on disk: number the shards, write the index, configs, tokenizer and the
    record, fsync, switch in (module docstring). Returns {name written: final name}."""
    shards = sorted((s for part in parts for s in part), key=lambda s: s.file)
    names = dict(zip((s.file for s in shards), shard_names(len(shards))))
    weight_map: dict[str, str] = {}
    for shard in shards:
        os.replace(staging / shard.file, staging / names[shard.file])
        for key in shard.keys:
            if key in weight_map:
                raise RuntimeError(f"{key} written twice ({weight_map[key]}, {names[shard.file]})")
            weight_map[key] = names[shard.file]
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(s.bytes for s in shards)}, "weight_map": dict(sorted(weight_map.items()))}
        (staging / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    if files.config is not None:
        files.config.save_pretrained(str(staging))
    if files.generation_config is not None:
        files.generation_config.save_pretrained(str(staging))
    if files.tokenizer is not None:
        files.tokenizer.save_pretrained(str(staging))
    if record is not None:
        (staging / RECORD).write_text(json.dumps(asdict(record), indent=1, sort_keys=True) + "\n")
    give_default_mode(staging)  # safetensors writes its shards 0600, the rest is 0644
    for root, directories, names_here in os.walk(staging, topdown=False):
        for name in names_here:
            fsync_path(Path(root) / name)
        fsync_path(Path(root))
    switch_in(staging, path)
    return names


def switch_in(staging: Path, path: Path) -> None:
    """Make the complete, fsynced `staging` directory `path`, and remove the previous `path` (module
    docstring)."""
    if path.exists() and exchange(staging, path):  # `path` is the new export, `staging` the old one
        fsync_path(path.parent)
        shutil.rmtree(staging, ignore_errors=True)
    else:
        old = old_dir(path)
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            os.replace(path, old)  # a kill between these two renames leaves the previous export in `old`
        os.replace(staging, path)
        fsync_path(path.parent)
        shutil.rmtree(old, ignore_errors=True)
    fsync_path(path.parent)


def exchange(a: Path, b: Path) -> bool:
    """Swap two directories atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(str(a)), at_fdcwd, os.fsencode(str(b)), rename_exchange) == 0


def read_export(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an export (sharded with its index, or a single `model.safetensors`) in one dict,
    keyed as in the files: for checks and tools; transformers' from_pretrained reads the directory as is."""
    from safetensors.torch import load_file

    path = Path(path)
    index = path / INDEX
    if not index.is_file():
        return load_file(str(path / SINGLE))
    weight_map = json.loads(index.read_text())["weight_map"]
    out: dict[str, torch.Tensor] = {}
    for file in sorted(set(weight_map.values())):
        part = load_file(str(path / file))
        if set(part) != {k for k, f in weight_map.items() if f == file}:
            raise ValueError(f"{path / file}: its tensors differ from what {index.name} maps to it")
        out.update(part)
    return out
