"""recipes.reliability.health: the pieces of the non-finite guard that need no training run."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import torch

from recipes.reliability.health import ZeroGradWatch, weights_finite
from recipes.training.run_log import nonfinite_keys, strict_json_row
from tests.distributed import run_ranks


def test_rows_are_strict_json_with_the_non_finite_keys_named():
    row = {"step": 2, "loss": math.nan, "grad_norm": math.inf, "lr": 1e-3, "tokens_per_s": 10.0}
    assert nonfinite_keys(row) == ["loss", "grad_norm"]
    text = json.dumps(strict_json_row(row), allow_nan=False)
    assert json.loads(text) == {"step": 2, "loss": None, "grad_norm": None, "lr": 1e-3, "tokens_per_s": 10.0,
                                "nonfinite": ["loss", "grad_norm"]}
    assert strict_json_row({"step": 1, "grad_norm": None}) == {"step": 1, "grad_norm": None}  # ZeRO-0: no norm


def test_a_gradient_norm_of_exactly_zero_for_three_steps_is_one_warning():
    watch = ZeroGradWatch()
    said = [watch.update(step, norm) for step, norm in enumerate([0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0], 1)]
    assert said[:5] == [None] * 5 and said[6] is None
    assert "exactly 0 for 3 steps (steps 4-6)" in said[5]


def test_the_deepspeed_engine_checks_its_own_partitions():
    from recipes.engines.deepspeed.engine import DeepSpeedEngine

    layer = torch.nn.Linear(3, 2)
    fake = SimpleNamespace(engine=SimpleNamespace(module=layer))
    assert DeepSpeedEngine.weights_finite(fake)
    layer.weight.ds_tensor = torch.tensor([1.0, math.inf])  # ZeRO-3: the partition this rank holds
    assert not DeepSpeedEngine.weights_finite(fake)


def _one_rank_has_inf(rank, world):
    engine = SimpleNamespace(weights_finite=lambda: rank != 1)
    assert weights_finite(engine, torch.device("cpu")) is False  # every rank learns of rank 1's shard
    assert weights_finite(SimpleNamespace(weights_finite=lambda: True), torch.device("cpu")) is True
    assert weights_finite(object(), torch.device("cpu")) is True  # an engine without the check


def test_non_finite_weights_on_one_rank_stop_every_rank():
    run_ranks(2, _one_rank_has_inf)
