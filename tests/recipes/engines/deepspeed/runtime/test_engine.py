"""recipes.engines.deepspeed.runtime.engine: the engine checks its own weights for non-finite values (the health
guard's `Engine.weights_finite`), under ZeRO-3 the partition this rank holds."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch


def test_the_deepspeed_engine_checks_its_own_partitions():
    from recipes.engines.deepspeed.runtime.engine import DeepSpeedEngine

    layer = torch.nn.Linear(3, 2)
    fake = SimpleNamespace(engine=SimpleNamespace(module=layer))
    assert DeepSpeedEngine.weights_finite(fake)
    layer.weight.ds_tensor = torch.tensor([1.0, math.inf])  # ZeRO-3: the partition this rank holds
    assert not DeepSpeedEngine.weights_finite(fake)
