"""recipes.training.router_loss: the router load-balancing loss (router/aux) of mixture-of-experts models, on
hand-computed cases (padding left out) and equal to a NumPy computation of the definition on random logits
(float32 and bf16 router logits); bad inputs refused. The engines' use of it:
tests/recipes/engines/deepspeed/runtime/test_moe.py and tests/recipes/engines/megatron/runtime/test_moe.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch


def numpy_router_aux(layers, top_k: int, coeff: float, real=None) -> float:
    """The definition, in float64 NumPy: sum over layers of coeff * E / (k T^2) * sum_e P_e c_e over the
    real tokens (`real`: a mask over the rows; None: all)."""
    total = 0.0
    for logits in layers:
        x = np.asarray(logits, dtype=np.float64).reshape(-1, np.shape(logits)[-1])
        if real is not None:
            x = x[np.asarray(real).reshape(-1).astype(bool)]
        tokens, experts = x.shape
        p = np.exp(x - x.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        chosen = np.argsort(-p, axis=1, kind="stable")[:, :top_k]
        counts = np.bincount(chosen.ravel(), minlength=experts)
        total += coeff * experts / (top_k * tokens**2) * float((p.sum(axis=0) * counts).sum())
    return total


def test_router_aux_on_hand_computed_cases():
    from recipes.training.router_loss import router_aux_loss

    ln3 = math.log(3.0)
    # two tokens, two experts, top-1: probabilities (1/4, 3/4) and (3/4, 1/4), one token each: P = (1, 1),
    # c = (1, 1), E / (k T^2) = 1/2: aux = 1/2 * (1 + 1) = 1
    balanced = torch.tensor([[0.0, ln3], [ln3, 0.0]])
    assert float(router_aux_loss([balanced], 1, 1.0)) == pytest.approx(1.0, rel=1e-6)
    # both tokens to expert 1: P = (1/2, 3/2), c = (0, 2): aux = 1/2 * 3 = 1.5; two such layers, coeff 0.1
    skewed = torch.tensor([[0.0, ln3], [0.0, ln3]])
    assert float(router_aux_loss([skewed, skewed], 1, 0.1)) == pytest.approx(0.3, rel=1e-6)
    # a padded position is no token: the balanced case plus padding routed to expert 1 is still 1
    padded = torch.tensor([[0.0, ln3], [ln3, 0.0], [0.0, 5.0]])
    assert float(router_aux_loss([padded], 1, 1.0, torch.tensor([True, True, False]))) == pytest.approx(1.0, rel=1e-6)
    assert float(router_aux_loss([padded], 1, 1.0)) != pytest.approx(1.0, rel=1e-3)
    assert float(router_aux_loss([padded], 1, 1.0, torch.zeros(3, dtype=torch.bool))) == 0.0  # no real token


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_router_aux_equals_numpy(top_k):
    from recipes.training.router_loss import router_aux_loss

    g = torch.Generator().manual_seed(top_k)
    layers = [torch.randn(37, 8, generator=g) * 2 for _ in range(3)]
    expected = numpy_router_aux([t.numpy() for t in layers], top_k, 0.01)
    assert float(router_aux_loss(layers, top_k, 0.01)) == pytest.approx(expected, rel=1e-6)
    # bf16 router logits (a bf16 model): the same softmax in float32 of the same bf16 values (distinct within
    # a row: bf16 rounding of random values makes ties, which either top-k may break its own way)
    steps = torch.arange(8) * 0.375 - 1.5
    low = [torch.stack([steps[torch.randperm(8, generator=g)] for _ in range(37)]).bfloat16() for _ in range(3)]
    expected = numpy_router_aux([t.float().numpy() for t in low], top_k, 0.01)
    assert float(router_aux_loss(low, top_k, 0.01)) == pytest.approx(expected, rel=1e-6)


def test_bad_router_inputs_are_refused():
    from recipes.training.router_loss import router_aux_coeff, router_aux_loss

    with pytest.raises(ValueError, match="top-k 5 must be in"):
        router_aux_loss([torch.zeros(3, 4)], 5, 1.0)
    with pytest.raises(ValueError, match="no router logits"):
        router_aux_loss([], 2, 1.0)
    from transformers import LlamaConfig

    with pytest.raises(ValueError, match="LlamaConfig does not have"):
        router_aux_coeff(None, LlamaConfig())
    with pytest.raises(ValueError, match="finite number >= 0"):
        router_aux_coeff(-1.0, LlamaConfig())
