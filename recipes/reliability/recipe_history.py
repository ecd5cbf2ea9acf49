"""The record of every recipe a run has trained with: `<out_dir>/recipe_history.jsonl`, and `recipe.yaml`.

One row per recipe, in step order: `{"first_step": n, "checkpoint": tag or null, "changed": {key: [old,
new]}, "lr_first_step": [old, new] or null, "recipe": {...}}`; the recipe of row i trained steps
`first_step_i` to `first_step_{i+1} - 1` (the last row's to the end). A new run writes the first row
(`first_step` 1); a resume that changes the recipe (`recipes.reliability.resume_policy`) appends one from the
first step after its checkpoint. Rows whose steps are trained again (a start from an older checkpoint)
are dropped, as metrics.jsonl drops the rows after the checkpoint, so the history describes the steps
metrics.jsonl holds: a result table can say that steps 1-10 used another weight (`recipe_of_step`).

`recipe.yaml` is the recipe in effect now (the last row's), rewritten only when a start trains: a refused
start, or a finished run started again, leaves it as it was. Both are written by rank 0 through a
temporary file and a rename.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from recipes.config import Recipe, dump_recipe

from .resume_policy import ResumePlan

HISTORY = "recipe_history.jsonl"


def read_history(out: Path) -> list[dict]:
    path = Path(out) / HISTORY
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def recipe_of_step(out: Path, step: int) -> dict | None:
    """The recipe that trained optimizer step `step` (1-based) of the run in `out` (None: unrecorded)."""
    found = None
    for row in read_history(out):
        if row["first_step"] <= step:
            found = row["recipe"]
    return found


def saved_recipe_fallback(out: Path):
    """For `resume_policy.plan_resume`: the recipe of a checkpoint saved before checkpoints recorded it,
    from this history, else from `recipe.yaml` (which an older version rewrote at every start)."""

    def fallback(step: int) -> tuple[dict | None, str]:
        recipe = recipe_of_step(out, step)
        if recipe is not None:
            return recipe, str(Path(out) / HISTORY)
        path = Path(out) / "recipe.yaml"
        if path.is_file():
            return yaml.safe_load(path.read_text()), str(path)
        return None, ""

    return fallback


def record_start(out: Path, recipe: Recipe, plan: ResumePlan) -> None:
    """Rank 0, once the engine has loaded the checkpoint `plan` names: the history up to it, a row for
    this recipe when it is new or changed, and `recipe.yaml`."""
    out = Path(out)
    rows = [row for row in read_history(out) if row["first_step"] <= plan.step]
    if not rows and plan.step > 0 and plan.old_recipe is not None:  # a run older than the history
        rows.append({"first_step": 1, "checkpoint": None, "changed": {}, "lr_first_step": None,
                     "recipe": plan.old_recipe, "note": f"recorded at the resume from {plan.tag}"})
    current = json.loads(json.dumps(recipe.to_dict()))  # as a row holds it
    if not rows or plan.changes or rows[-1]["recipe"] != current:  # (the last: a history edited by hand)
        rows.append({"first_step": plan.first_step, "checkpoint": plan.tag, "changed": plan.changed(),
                     "lr_first_step": list(plan.lr_first_step) if plan.lr_first_step else None,
                     "recipe": current})
    tmp = out / f".{HISTORY}.tmp"
    tmp.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))
    os.replace(tmp, out / HISTORY)
    tmp = out / ".recipe.yaml.tmp"
    dump_recipe(recipe, tmp)
    os.replace(tmp, out / "recipe.yaml")
