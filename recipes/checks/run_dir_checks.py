"""The run directory against the recipe, before any model is built: `train.out_dir` can be made and written,
and the checkpoint the run would resume from was saved by this engine at a layout it can load.

- `train.out_dir` (or a part of its path) naming a file, or a directory the run may not write, is
  refused (it would fail at the lock or the first save, after the model was built).
- Resume: the checkpoint `checkpoints/latest` names is read for its `layout.json` only (it is verified
  byte for byte later, at resume: `recipes.reliability.checkpoints`). A checkpoint another engine saved
  (each engine's contract recognises its own layout: `saved_by`) is refused; one of this engine is asked
  its contract's `resume_problem` (DeepSpeed: the same tensor-parallel size, ZeRO stage and LoRA, and
  for LoRA the same data-parallel size: a 70B base would otherwise load before the refusal; Megatron's
  checkpoints reshard onto any layout). The checkpoint the run resumes from once `latest` is verified
  (a fallback, a recovered save) is compared again by the resume policy, before any model is built
  (`recipes.reliability.resume_policy.checkpoint_layout_problems`, the one copy of this rule).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from recipes.reliability.resume_policy import checkpoint_layout_problems


def out_dir_problems(recipe) -> list[str]:
    out = Path(recipe.train.out_dir)
    if out.exists() and not out.is_dir():
        return [f"train.out_dir: {out} is a file, not a directory: name a directory for the run"]
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return [f"train.out_dir: {existing} is a file, so {out} cannot be created: name a directory for the run"]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [f"train.out_dir: {existing} is not writable by this user, so the run cannot {'write into' if existing == out else 'create'} {out}"]
    return []


def latest_layout(out_dir: str | Path) -> tuple[Path, dict] | None:
    """(the checkpoint `latest` names, its layout.json) of a run directory; None without either."""
    root = Path(out_dir) / "checkpoints"
    marker = root / "latest"
    if not marker.is_file():
        return None
    directory = root / marker.read_text().strip()
    try:
        return directory, json.loads((directory / "layout.json").read_text())
    except (OSError, ValueError):  # missing or unreadable: the resume's verification names the file
        return None


def resume_problems(recipe, data_parallel: int) -> list[str]:
    """Errors of resuming `recipe` on `data_parallel` data-parallel ranks from its run directory's latest
    checkpoint (module docstring); none without a checkpoint."""
    found = latest_layout(recipe.train.out_dir)
    if found is None:
        return []
    directory, saved = found
    return checkpoint_layout_problems(recipe, data_parallel, directory, saved)
