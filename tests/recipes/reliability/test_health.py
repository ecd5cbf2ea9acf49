"""recipes.reliability.health: the pieces of the non-finite guard that need no training run, and the advice
a non-finite stop gives: "lower optim.lr" only when the run's own updates can have made the values
non-finite."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from recipes.reliability.health import NonFiniteTraining, ZeroGradWatch, weights_finite
from tests.distributed import run_ranks


def test_nonfinite_advice_follows_the_cause():
    after = str(NonFiniteTraining(7, ["loss", "ce", "grad_norm"], "step_00000005"))
    assert "Lower optim.lr" in after and "step_00000005 (finite)" in after
    first = str(NonFiniteTraining(6, ["loss", "ce", "grad_norm"], "step_00000005", before_any_update=True))
    assert "the learning rate is not the cause" in first and "optim.lr" not in first
    term = str(NonFiniteTraining(3, ["loss", "term/ntl_mse", "grad_norm"], None))
    assert "numeric term ntl_mse overflowed" in term and "optim.lr" not in term


def test_a_gradient_norm_of_exactly_zero_for_three_steps_is_one_warning():
    watch = ZeroGradWatch()
    said = [watch.update(step, norm) for step, norm in enumerate([0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0], 1)]
    assert said[:5] == [None] * 5 and said[6] is None
    assert "exactly 0 for 3 steps (steps 4-6)" in said[5]


def _one_rank_has_inf(rank, world):
    engine = SimpleNamespace(weights_finite=lambda: rank != 1)
    assert weights_finite(engine, torch.device("cpu")) is False  # every rank learns of rank 1's shard
    assert weights_finite(SimpleNamespace(weights_finite=lambda: True), torch.device("cpu")) is True
    assert weights_finite(object(), torch.device("cpu")) is True  # an engine without the check


def test_non_finite_weights_on_one_rank_stop_every_rank():
    run_ranks(2, _one_rank_has_inf)
