"""What model an evaluation scores, as the run that exported it records: `final/`'s `numloss_export.json`
(written last by `recipes.reliability.export_writer`) against the run directory around it.

- `--model` a local path that is not a directory (a run whose `final/` was never written, a typo) is
  refused in one line naming the path and how `final/` is made (`ModelRefused`; `python -m recipes.evaluate`
  exits 2), before any data or model is read: transformers would take the path for a Hub id and fail on its
  form, or try the network.
- An export older than its run's last step (the run trained on after `final/` was written, or an export
  failed) is scored, with a warning naming both steps and how to export the newer one.
- The results record the step scored (`export_of`: step, checkpoint, engine, the run's last step), so a
  table of runs cannot show an old model under the run's name unnoticed. A model without a record (a Hub id,
  a directory saved by other tools) is scored as it is, its `export` None.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from recipes.reliability.checkpoints import LATEST, read_latest, tag_step
from recipes.reliability.export_writer import read_record

TRAIN_COMMAND = "python -m recipes.train RECIPE.yaml"


class ModelRefused(ValueError):
    """`--model` names a local directory that is not there."""


def _looks_local(model: str) -> bool:
    """Whether `model` is meant as a local path rather than a Hub id ('org/name' or 'name')."""
    if model.startswith((".", "/", "~")) or model.count("/") >= 2 or os.sep != "/" and os.sep in model:
        return True
    parent = Path(model).parent
    return str(parent) not in ("", ".") and parent.is_dir()


def _run_last_step(run: Path) -> tuple[int | None, str]:
    """The last step the run directory `run` trained to, and where that is read from."""
    tag, _ = read_latest(run / "checkpoints")
    steps = [(tag_step(tag), f"its checkpoints/{LATEST}, {tag}")] if tag else []
    metrics = run / "metrics.jsonl"
    if metrics.is_file():
        try:
            steps.append((int(json.loads(metrics.read_text().splitlines()[-1])["step"]), "its metrics.jsonl"))
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            pass  # an empty or damaged log: the checkpoints say it
    return max(steps, key=lambda found: found[0]) if steps else (None, "")  # a tie: the checkpoint


def export_of(model: str) -> tuple[dict | None, str | None]:
    """The export record of `model` for the results ({"step", "checkpoint", "engine", "run_last_step"}, None:
    no record) and a warning when the run trained past it (None: none). Raises `ModelRefused` for a local
    path that is not a directory."""
    path = Path(os.path.expanduser(model))
    if not path.is_dir():
        if not _looks_local(model):
            return None, None  # a Hub id: transformers reads it (offline: its own error)
        run = path.parent
        tag, _ = read_latest(run / "checkpoints")
        hint = (f"; {run} has checkpoint {tag}: run the same `{TRAIN_COMMAND}` command again and it writes "
                f"{path.name}/ from it once the run has reached train.steps" if tag else
                f"; {path.name}/ is written by `{TRAIN_COMMAND}` when a run with train.export: true finishes "
                f"(`train.out_dir`/final)")
        raise ModelRefused(f"--model {model}: no such directory{hint}")
    record = read_record(path)
    if record is None:
        return None, None
    last, where = _run_last_step(path.parent)
    found = {"step": record.step, "checkpoint": record.checkpoint, "engine": record.engine, "run_last_step": last}
    if last is None or last <= record.step:
        return found, None
    return found, (f"{path} holds the model of step {record.step} (from checkpoint {record.checkpoint}), but its run "
                   f"{path.parent} trained to step {last} ({where}): scoring step {record.step}. To score step "
                   f"{last}, run the run's `{TRAIN_COMMAND}` command again (it exports its last checkpoint)")
