"""Each term's scale against CE before a run's first update (`recipes.training.scale_check`), in one process:
a CE-only recipe (or a term at weight 0, or rescaled to CE) runs no forward; an engine that cannot run a
forward outside a step (`eval_problem`) leaves it to step 1's logged row; `scale_advice`'s line.

Through `python -m recipes.train` on both engines (the line before step 1, its CE against transformers in
float64, the training unchanged to the bit, a resume that does not say it again): test_eval_step_in_training.py,
whose runs also serve the held-out evaluation.
"""

from __future__ import annotations

import pytest
import torch

from numloss import ObjectiveConfig
from recipes.config import Recipe
from recipes.training.scale_check import first_step_scale, scale_advice


class _Engine:
    """Only what `first_step_scale` may ask before it runs a forward."""

    def __init__(self, problem: str | None = None):
        self.problem, self.forwards = problem, 0

    def eval_problem(self):
        return self.problem

    def eval_step(self, window, answers=True):
        self.forwards += 1
        raise AssertionError("no forward expected")


@pytest.mark.parametrize("terms", [{}, {"smmd": {"weight": 0}}, {"smmd": {"rescale_to_ce": True}}])
def test_no_forward_when_no_term_can_be_named(terms):
    recipe = Recipe(name="r")
    recipe.loss.objective = ObjectiveConfig.from_dict({"terms": terms})
    engine = _Engine()
    assert first_step_scale(recipe, engine, [], torch.device("cpu")) == [] and engine.forwards == 0


def test_an_engine_without_a_forward_outside_a_step_leaves_it_to_step_1():
    recipe = Recipe(name="r")
    recipe.loss.objective = ObjectiveConfig.from_dict({"terms": {"smmd": {}}})
    engine = _Engine(problem="no forward outside a training step")
    assert first_step_scale(recipe, engine, [], torch.device("cpu")) is None and engine.forwards == 0


def test_scale_advice_names_a_term_many_times_ce():
    recipe = Recipe(name="r")
    recipe.loss.objective = ObjectiveConfig.from_dict({"terms": {"ntl_was": {}, "smmd": {}}})
    values = {"ce": 10.0, "term/ntl_was": 200.0, "term/smmd": 1.0}
    lines = scale_advice(recipe, values, "step 1's global batch")
    assert len(lines) == 1 and "term ntl_was = 200 x weight 0.3 = 60 is 6.0x CE (10)" in lines[0]
    assert "weight 0.05 would make it equal CE" in lines[0] and "on step 1's global batch:" in lines[0]
    assert scale_advice(recipe, {**values, "term/ntl_was": 100.0}, "step 1's global batch") == []
