"""`router/aux`: the load-balancing loss of a mixture-of-experts model's routers, defined once for both
engines.

For each MoE layer l, with the T real tokens of one micro-batch of one data-parallel rank (padding left
out, all sequence-parallel shards together), E experts and top-k routing:

    aux_l = coeff * E / (k * T^2) * sum_e P_e * c_e
    P_e   = sum_t softmax(router_logits_l[t])[e]      (differentiable)
    c_e   = number of the T * k top-k selections that went to expert e   (a count: no gradient)

and router/aux = sum_l aux_l. This is Megatron-core's per-layer switch-style "aux_loss"
(`switch_load_balancing_loss_func`: probs.sum(0) * tokens_per_expert * E * coeff / (k * T^2)), which the
Megatron engine adds in each MoE layer's router; the DeepSpeed engine recomputes the same number from the
HF model's router logits. It is not HF's `load_balancing_loss_func` (the `aux_loss` an HF MoE model
returns): that one concatenates every layer's tokens into one T * L pool before the product, normalises
the counts by tokens rather than by token selections (so it is k times larger) over that
concatenated pool. The two agree only for one layer and k = 1; numloss never uses HF's.

Padding is left out (megatron-core's `padding_mask`, which the Megatron engine passes) because its
amount depends on the layout: each engine pads a micro-batch to its own lengths (pad_to_multiple_of,
Megatron's TP and THD padding), and router/aux must be the same number on every layout. A micro-batch
with no real token contributes 0.

Over a step the logged router/aux is the mean of the per-micro-batch values over the micro-batches and the
data-parallel ranks; its gradient is the gradient of that mean (Megatron: MoEAuxLossAutoScaler's scale
1 / num_microbatches and the data-parallel gradient average; DeepSpeed: the engine's scaling,
`recipes.engines.deepspeed.runtime.engine`). Routing choices do not depend on the coefficient, so `coeff = 0`
(off) leaves the objective exactly what it is for a dense model.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch


def layer_balance(router_logits: torch.Tensor, top_k: int, real: torch.Tensor | None = None) -> torch.Tensor:
    """sum_e P_e * c_e * E / (k * T^2) of one MoE layer (aux_l without the coefficient), in float32.
    `router_logits`: `[..., E]`, one row per token that went through the router; `real`: a bool mask over
    those rows (True: a real token; None: every row is one)."""
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"router top-k {top_k} must be in [1, {num_experts}] (the router's experts)")
    logits = router_logits.reshape(-1, num_experts)
    if real is not None:
        real = real.reshape(-1).to(logits.device)
        if real.numel() != logits.shape[0]:
            raise ValueError(f"router/aux: a real-token mask of {real.numel()} positions for router logits of "
                             f"{logits.shape[0]} tokens")
        logits = logits[real.bool()]
    tokens = logits.shape[0]
    if tokens == 0:  # no real token: no load to balance
        return router_logits.sum() * 0.0
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    with torch.no_grad():  # the routing choice: the HF routers' own top-k of the float32 softmax
        chosen = torch.topk(probs, top_k, dim=-1).indices.reshape(-1)
        counts = torch.zeros(num_experts, dtype=torch.float32, device=logits.device)
        counts.scatter_add_(0, chosen, torch.ones_like(chosen, dtype=torch.float32))
    return (probs.sum(dim=0) * counts).sum() * (num_experts / (top_k * tokens * tokens))


def router_aux_loss(router_logits: Sequence[torch.Tensor], top_k: int, coeff: float,
                    real: torch.Tensor | None = None) -> torch.Tensor:
    """router/aux of one micro-batch: coeff * the sum over MoE layers of `layer_balance` (module docstring).
    `router_logits`: one `[T, E]` tensor per MoE layer, in layer order; `real`: which of the T positions
    are real tokens (the same for every layer; None: all)."""
    if not router_logits:
        raise ValueError("router/aux: no router logits were recorded (is this a mixture-of-experts model?)")
    return coeff * torch.stack([layer_balance(logits, top_k, real) for logits in router_logits]).sum()


def router_aux_coeff(configured: float | None, hf_config) -> float:
    """The coefficient a run uses: `loss.router_aux_coeff` when set, else the HF config's
    `router_aux_loss_coef` (its language model's, for a config with a `text_config`)."""
    if configured is not None:
        coeff = float(configured)
    else:
        text = getattr(hf_config, "text_config", None) or hf_config
        value = getattr(text, "router_aux_loss_coef", None)
        if value is None:
            raise ValueError(f"loss.router_aux_coeff: null takes the model config's router_aux_loss_coef, which "
                             f"{type(text).__name__} does not have; set loss.router_aux_coeff")
        coeff = float(value)
    if not math.isfinite(coeff) or coeff < 0:
        raise ValueError(f"loss.router_aux_coeff: must be a finite number >= 0, got {coeff}")
    return coeff
