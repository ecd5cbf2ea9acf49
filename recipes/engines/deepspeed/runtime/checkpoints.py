"""DeepSpeed's part of a run's checkpoints: its own state in the step directory, and resuming onto
another data-parallel size (`recipes.reliability.checkpoints` owns the directories and `latest`).

DeepSpeed 0.19.8 loads ZeRO optimizer state only onto the data-parallel size that saved it; for another
size the checkpoint is converted once to DeepSpeed's universal format (`deepspeed.checkpoint.
ds_to_universal`, into `<tag>_universal`) and loaded with `checkpoint.load_universal`. A changed
tensor-parallel size or ZeRO stage is refused.

The conversion (~850 GB at 70B) runs on rank 0 as a subprocess with several workers and a timeout of its
own, `conversion_timeout_s` (10 minutes + the checkpoint's size at CONVERT_BYTES_PER_S, an assumption);
it writes into `.<tag>_universal.partial`, renamed when complete and kept when it fails or times out (a
rerun writes into it again: DeepSpeed 0.19.8 re-extracts every shard, it has no resume). The other ranks
do not wait in a collective (which would time out after train.dist_timeout_minutes): they wait on the
process group's store for rank 0's result, up to the same deadline, then fail with rank 0's message.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from recipes.reliability.checkpoint_writes import guarded_write
from recipes.reliability.checkpoints import CheckpointDirs

from ..pure.contract import resume_problem


def universal_tag_to_load(dirs: CheckpointDirs, layout: dict, ds_config: dict) -> str | None:
    """Before `deepspeed.initialize`: when the latest checkpoint was saved over another number of ZeRO
    partitions (another data-parallel size, or sequence-parallel size: `zero_partitions`),
    convert it to the universal format (rank 0, once), set `ds_config` to load that, and return the tag
    to load (None: load the latest as it is). Refuses a changed tensor-parallel size or ZeRO stage, and
    LoRA at another data-parallel size (`resume_problem`). Every rank calls it."""
    saved = dirs.saved_layout()
    if saved is None:
        return None
    tag = dirs.latest_tag()
    problem = resume_problem(saved, layout, dirs.root / tag)
    if problem:
        raise ValueError(problem)
    if zero_partitions(saved) == zero_partitions(layout):
        return None
    universal = f"{tag}_universal"
    convert_once(dirs.root / tag, dirs.root / universal, dirs.runtime.is_main)
    ds_config["checkpoint"] = {**ds_config.get("checkpoint", {}), "load_universal": True}
    return universal


def zero_partitions(layout: dict) -> int | None:
    """How many ranks ZeRO partitioned the state over: the data-parallel size times the sequence-parallel
    size (DeepSpeed-Ulysses shards over every rank of the sequence x data-parallel group)."""
    dp = layout.get("data_parallel")
    return None if dp is None else dp * layout.get("sequence_parallel", 1)


CONVERT_BYTES_PER_S = 100e6  # the slowest conversion rate assumed (one worker reads ~200-500 MB/s)


def checkpoint_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def conversion_timeout_s(size_bytes: int) -> float:
    return 600 + size_bytes / CONVERT_BYTES_PER_S


def conversion_workers() -> int:
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def ds_to_universal_command(src: Path, out: Path, workers: int) -> list[str]:
    return [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(src),
            "--output_folder", str(out), "--num_extract_workers", str(workers),
            "--num_merge_workers", str(max(1, workers // 2))]  # merging holds more memory per worker


def convert_once(src: Path, dst: Path, is_main: bool, *, command: Callable[[Path, Path, int], list[str]] | None = None,
                 timeout_s: float | None = None) -> None:
    """Rank 0 converts `src` into `dst` (unless `dst` exists); every rank returns once it is there, or
    raises with rank 0's error. Every rank calls it (module docstring)."""
    timeout_s = timeout_s or conversion_timeout_s(checkpoint_size(src))
    key = f"numloss/universal/{dst.name}"
    store = dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
    if is_main:
        message = "ok"
        if not dst.is_dir():
            partial = dst.parent / f".{dst.name}.partial"  # kept on failure, for a rerun to write into
            cmd = (command or ds_to_universal_command)(src, partial, conversion_workers())
            try:
                subprocess.run(cmd, check=True, timeout=timeout_s)
                os.replace(partial, dst)
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as err:
                message = (f"the universal-checkpoint conversion of {src} failed ({type(err).__name__}: {err}); its "
                           f"partial output is kept in {partial}")
        if store is not None:
            store.set(key, message)
        if message != "ok":
            raise RuntimeError(message)
        return
    if store is None:
        return
    store.set_timeout(datetime.timedelta(seconds=timeout_s + 60))
    try:
        store.wait([key])
    except Exception as err:  # noqa: BLE001  (the store's timeout)
        raise RuntimeError(f"rank 0 did not finish converting {src} within {timeout_s + 60:.0f} s") from err
    message = store.get(key).decode()
    if message != "ok":
        raise RuntimeError(f"rank 0: {message}")


# torch's load_state_dict when the module is not the one saved (another width, depth or LoRA targets)
_OTHER_MODEL = ("size mismatch", "Missing key(s)", "Unexpected key(s)")


def load_failure_hint(err: BaseException, directory: Path) -> str:
    """What can help after a failed load: an older checkpoint helps a damaged one, never one of another
    model (every checkpoint of the run holds that model)."""
    if any(marker in str(err) for marker in _OTHER_MODEL):
        return (f"The checkpoint holds another model than this recipe builds (model.config, model.name_or_path or "
                f"model.lora changed since it was saved; {directory.parent.parent / 'recipe.yaml'} is the recipe it "
                f"trained with): start again with that recipe, or train this one into a new train.out_dir")
    return (f"If the checkpoint is damaged, an older one can be loaded: echo step_XXXXXXXX > "
            f"{directory.parent / 'latest'}")


def save_state(engine, directory: Path, step: int, trainable_only: bool = False) -> None:
    """DeepSpeed's model, optimizer and schedule state into `directory` (a step directory).
    `trainable_only` (LoRA): the frozen base is left out, as it is rebuilt at every start; a 70B base
    would otherwise add ~140 GB to every checkpoint.

    DeepSpeed writes through `torch.save` (a failure is held until every rank can agree:
    `recipes.reliability.checkpoint_writes`), except rank 0's copy of its recovery scripts (shutil, between
    its writes and its closing barrier), registered here to be held the same way."""
    with guarded_write(engine, "_copy_recovery_script", "DeepSpeed's recovery scripts (zero_to_fp32.py)"):
        engine.save_checkpoint(str(directory.parent), tag=directory.name, client_state={"step": step},
                               save_latest=False, exclude_frozen_parameters=trainable_only)


def load_state(engine, directory: Path, tag: str | None = None, trainable_only: bool = False) -> None:
    """Load `directory`'s DeepSpeed state (or the sibling `tag`, a universal conversion of it).
    `trainable_only`: the checkpoint has the trainable parameters only; the module's others stay as built."""
    source = directory.parent / (tag or directory.name)
    try:
        path, _ = engine.load_checkpoint(str(directory.parent), tag=tag or directory.name,
                                         load_module_strict=not trainable_only)
    except Exception as err:  # DeepSpeed's own errors name no file (`PytorchStreamReader failed ...`)
        files = sorted(p.name for p in source.glob("*") if p.is_file())
        raise RuntimeError(f"DeepSpeed could not load the checkpoint {source} ({type(err).__name__}: {err}); its "
                           f"files: {', '.join(files) or 'none'}. {load_failure_hint(err, directory)}") from err
    if path is None:
        raise RuntimeError(f"checkpoint {source} could not be loaded by DeepSpeed (no files for this layout)")
