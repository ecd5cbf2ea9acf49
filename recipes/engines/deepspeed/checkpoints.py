"""DeepSpeed's part of a run's checkpoints: its own state in the step directory, and resuming onto
another data-parallel size (`recipes.training.checkpoints` owns the directories and `latest`).

DeepSpeed 0.19.8 loads ZeRO optimizer state only onto the data-parallel size that saved it; for another
size the checkpoint is converted once to DeepSpeed's universal format (`deepspeed.checkpoint.
ds_to_universal`, into `<tag>_universal`) and loaded with `checkpoint.load_universal`. A changed
tensor-parallel size or ZeRO stage is refused.
"""

from __future__ import annotations

import os
import shutil
from argparse import Namespace
from pathlib import Path

import torch.distributed as dist

from recipes.training.checkpoints import CheckpointDirs


def universal_tag_to_load(dirs: CheckpointDirs, layout: dict, ds_config: dict) -> str | None:
    """Before `deepspeed.initialize`: when the latest checkpoint was saved at another data-parallel size,
    convert it to the universal format (rank 0, once), set `ds_config` to load that, and return the tag
    to load (None: load the latest as it is). Refuses a changed tensor-parallel size or ZeRO stage.
    Every rank calls it."""
    saved = dirs.saved_layout()
    if saved is None:
        return None
    tag = dirs.latest_tag()
    for key in ("tensor_parallel", "zero_stage", "lora"):
        if saved.get(key) != layout.get(key):
            raise ValueError(f"{dirs.root / tag} was saved with {key}={saved.get(key)}; this run has"
                             f" {layout.get(key)}: resume with the same {key}")
    if saved.get("data_parallel") == layout.get("data_parallel"):
        return None
    if layout.get("lora"):  # ds_to_universal expects every parameter in the checkpoint (not run here)
        raise ValueError(f"{dirs.root / tag} was saved with data_parallel={saved.get('data_parallel')}; a LoRA run"
                         f" resumes onto the same data-parallel size only (this run has {layout.get('data_parallel')})")
    universal = f"{tag}_universal"
    if dirs.runtime.is_main and not (dirs.root / universal).is_dir():
        from deepspeed.checkpoint.ds_to_universal import main as to_universal

        tmp = dirs.root / f".{universal}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        to_universal(Namespace(input_folder=str(dirs.root / tag), output_folder=str(tmp), num_extract_workers=1,
                               num_merge_workers=1, keep_temp_folder=False, strict=True,
                               inject_missing_state=False))
        os.replace(tmp, dirs.root / universal)
    dist.barrier()
    ds_config["checkpoint"] = {**ds_config.get("checkpoint", {}), "load_universal": True}
    return universal


def save_state(engine, directory: Path, step: int, trainable_only: bool = False) -> None:
    """DeepSpeed's model, optimizer and schedule state into `directory` (a step directory).
    `trainable_only` (LoRA): the frozen base is left out, as it is rebuilt at every start; a 70B base
    would otherwise add ~140 GB to every checkpoint."""
    engine.save_checkpoint(str(directory.parent), tag=directory.name, client_state={"step": step}, save_latest=False,
                           exclude_frozen_parameters=trainable_only)


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
                           f"files: {', '.join(files) or 'none'}. An older checkpoint: point "
                           f"{directory.parent / 'latest'} at it") from err
    if path is None:
        raise RuntimeError(f"checkpoint {source} could not be loaded by DeepSpeed (no files for this layout)")
