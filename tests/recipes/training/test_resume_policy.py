"""recipes.reliability.resume_policy and recipe_history without processes: the decisions a real run does not
reach in tests/recipes/reliability/test_reliability_resume.py (which runs the rest end to end)."""

from __future__ import annotations

import json

import pytest
import yaml

from recipes.config import recipe_from_dict
from recipes.reliability.recipe_history import HISTORY, read_history, record_start, recipe_of_step
from recipes.reliability.resume_policy import ResumeRefused, decide


def _recipe(tmp_path, *overrides: str):
    base = {"name": "r", "model": {"config": {"model_type": "llama"}, "tokenizer": "tok"},
            "data": {"train": "data"}, "loss": {"objective": {"terms": {"smmd": {}}}},
            "optim": {"lr": 1e-3, "warmup_steps": 0, "schedule": "constant"},
            "train": {"steps": 10, "out_dir": str(tmp_path), "export": False}}
    return recipe_from_dict(base, list(overrides))


def test_a_default_weight_written_out_and_a_grown_schema_are_no_change(tmp_path):
    saved = _recipe(tmp_path).to_dict()
    del saved["data"]["length_bucketing"]  # a field added to the schema after the checkpoint was saved
    plan = decide(_recipe(tmp_path, "loss.objective={terms: {smmd: {weight: 3.0}}}"), "step_00000004", saved, tmp_path)
    assert plan.changes == [] and not plan.finished and plan.first_step == 5
    plan = decide(_recipe(tmp_path, "loss.objective={terms: {smmd: {weight: 1.0}, ntl_was: {}}}"), "step_00000004",
                  saved, tmp_path)
    assert {c.key: (c.old, c.new) for c in plan.changes} == {
        "loss.objective.terms.smmd.weight": (3.0, 1.0),
        "loss.objective.terms.ntl_was": ("(absent)", {"weight": 0.3, "options": {}, "rescale_to_ce": False})}


def test_fewer_steps_than_the_checkpoint_and_a_run_without_a_recorded_recipe(tmp_path):
    with pytest.raises(ResumeRefused, match=r"train.steps: 3 is below step 4, where this run's checkpoint"):
        decide(_recipe(tmp_path, "train.steps=3"), "step_00000004", _recipe(tmp_path).to_dict(), tmp_path)
    plan = decide(_recipe(tmp_path, "optim.lr=1.0"), "step_00000004", None, tmp_path)  # saved before recipe.json
    assert plan.changes == [] and "does not record the recipe it was trained with" in plan.warnings[0]
    # train.steps lowered to the checkpoint's step (stop here): with an export to write, the run exports;
    # without, there is nothing to do; neither is refused
    plan = decide(_recipe(tmp_path, "train.steps=4", "train.export=true"), "step_00000004",
                  _recipe(tmp_path, "train.export=true").to_dict(), tmp_path)
    assert not plan.finished and [c.key for c in plan.changes] == ["train.steps"]
    plan = decide(_recipe(tmp_path, "train.steps=4"), "step_00000004", _recipe(tmp_path).to_dict(), tmp_path)
    assert plan.finished and "Ignored: train.steps: 10 -> 4" in plan.message


def test_history_keeps_the_recipes_of_the_steps_metrics_keeps(tmp_path):
    a, b, c = _recipe(tmp_path), _recipe(tmp_path, "optim.lr=5e-4"), _recipe(tmp_path, "optim.lr=1e-4")
    record_start(tmp_path, a, decide(a, None, None, tmp_path))
    record_start(tmp_path, b, decide(b, "step_00000004", a.to_dict(), tmp_path))
    assert [(r["first_step"], r["changed"]) for r in read_history(tmp_path)] == [
        (1, {}), (5, {"optim.lr": [1e-3, 5e-4]})]
    assert recipe_of_step(tmp_path, 4)["optim"]["lr"] == 1e-3 and recipe_of_step(tmp_path, 5)["optim"]["lr"] == 5e-4
    # b crashed before its first checkpoint; the run starts again from step 4 with c: b's row goes
    record_start(tmp_path, c, decide(c, "step_00000004", a.to_dict(), tmp_path))
    assert [(r["first_step"], r["recipe"]["optim"]["lr"]) for r in read_history(tmp_path)] == [(1, 1e-3), (5, 1e-4)]
    assert yaml.safe_load((tmp_path / "recipe.yaml").read_text())["optim"]["lr"] == 1e-4
    # the same recipe from a later checkpoint: no new row; an older run without a history gets its first row
    record_start(tmp_path, c, decide(c, "step_00000008", c.to_dict(), tmp_path))
    assert len(read_history(tmp_path)) == 2
    (tmp_path / HISTORY).unlink()
    record_start(tmp_path, c, decide(c, "step_00000008", a.to_dict(), tmp_path))
    rows = [json.loads(line) for line in (tmp_path / HISTORY).read_text().splitlines()]
    assert [(r["first_step"], r["recipe"]["optim"]["lr"]) for r in rows] == [(1, 1e-3), (9, 1e-4)]
