"""Mixture-of-experts Hugging Face models under the DeepSpeed engine: their router logits, recorded during
the training module's forward, become `router/aux` (`recipes.training.router_loss`) beside the objective.

What a user gets on DeepSpeed: the HF model as it is, every expert on every data-parallel rank (ZeRO 1-2
shard the experts' optimizer state and gradients, ZeRO-3 their weights too, over all data-parallel ranks
like any parameter); no expert parallelism (`megatron.ep_size` is the Megatron engine's) and no AutoTP
for MoE models. The HF model routes dropless (every token reaches its top-k experts).

Why hooks on the routers, not the HF model's `output_router_logits=True` output: the training module runs
the model two ways (the full forward for logits, or only the backbone for the chunked head), and both
keep only the logits or the last hidden states; a forward hook on each router module (the class HF
itself records `router_logits` from, `_can_record_outputs`) sees the same tensor on either path. Hooks
record only inside the training module's forward, so gradient checkpointing's recomputation in backward
records nothing. HF's own `aux_loss` is a different number and is never used (router_loss's docstring).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from numloss.adapters.hf import NumericCausalLM
from recipes.training.router_loss import router_aux_coeff, router_aux_loss

# families whose router is softmax over all experts, then top-k (Megatron's "aux_loss" applies as defined);
# qwen2_moe's shared expert has its own sigmoid gate, outside the routed experts and the loss
SOFTMAX_TOPK_FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe")


@dataclass(frozen=True)
class MoeRouting:
    """A model's routers as router/aux needs them: which modules output the logits, and k and the weight."""

    model_type: str
    router_class: type
    logits_index: int  # position of the logits in the router module's output tuple
    num_experts: int
    top_k: int
    coeff: float


def is_moe_model(model) -> bool:
    """Whether HF model `model` routes tokens to experts (its class records `router_logits`)."""
    return "router_logits" in (getattr(type(model), "_can_record_outputs", None) or {})


def moe_routing(model, configured_coeff: float | None) -> MoeRouting | None:
    """The routing of HF model `model` for router/aux, or None: a dense model, or router/aux off
    (`loss.router_aux_coeff: 0`). A mixture-of-experts model of a family whose router is not softmax-then-
    top-k is refused unless router/aux is off: its load-balancing loss is not the one numloss defines."""
    recorder = (getattr(type(model), "_can_record_outputs", None) or {}).get("router_logits")
    if recorder is None:
        return None
    config = getattr(model.config, "text_config", None) or model.config
    model_type = getattr(config, "model_type", type(model).__name__)
    if configured_coeff is not None and configured_coeff == 0:
        return None
    if model_type not in SOFTMAX_TOPK_FAMILIES:
        raise ValueError(f"model: {type(model).__name__} ({model_type}) is a mixture-of-experts model whose "
                         f"load-balancing loss numloss does not define (router/aux: {', '.join(SOFTMAX_TOPK_FAMILIES)}); "
                         f"set loss.router_aux_coeff: 0 to train it without one")
    num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    return MoeRouting(model_type=model_type, router_class=recorder.target_class, logits_index=recorder.index,
                      num_experts=int(num_experts), top_k=int(config.num_experts_per_tok),
                      coeff=router_aux_coeff(configured_coeff, config))


class RouterLogits:
    """Forward hooks on every router of `model` that, inside `recording()`, collect each router's logits
    (`[tokens, experts]`, in the order the layers run) into the list it yields."""

    def __init__(self, model: torch.nn.Module, routing: MoeRouting):
        self.index = routing.logits_index
        self.recorded: list[torch.Tensor] | None = None
        routers = [m for m in model.modules() if isinstance(m, routing.router_class)]
        if not routers:
            raise ValueError(f"{type(model).__name__}: no {routing.router_class.__name__} module to record "
                             "router logits from")
        self.handles = [m.register_forward_hook(self._hook) for m in routers]

    def _hook(self, module, args, output) -> None:
        if self.recorded is not None:
            self.recorded.append(output[self.index] if isinstance(output, (tuple, list)) else output)

    @contextlib.contextmanager
    def recording(self):
        self.recorded = []
        try:
            yield self.recorded
        finally:
            self.recorded = None


class MoeNumericCausalLM(NumericCausalLM):
    """NumericCausalLM whose output also holds `router_aux`: router/aux of the batch (a differentiable
    scalar, `recipes.training.router_loss.router_aux_loss`), not added to `loss`: the engine adds it with
    the scaling its gradient accumulation and data parallelism need."""

    def __init__(self, model, objective, routing: MoeRouting, **options):
        super().__init__(model, objective, **options)
        self.routing = routing
        self.router_logits = RouterLogits(model, routing)

    def forward(self, input_ids, labels, attention_mask=None, **kwargs):
        with self.router_logits.recording() as logits:
            out = super().forward(input_ids, labels, attention_mask, **kwargs)
        for layer in logits:
            if layer.shape[-1] != self.routing.num_experts:
                raise ValueError(f"router logits have {layer.shape[-1]} experts, the config "
                                 f"{self.routing.num_experts}")
        real = real_tokens(attention_mask, kwargs.get("sequence_ids"))
        out["router_aux"] = router_aux_loss(logits, self.routing.top_k, self.routing.coeff, real)
        return out


def real_tokens(attention_mask: torch.Tensor | None, sequence_ids: torch.Tensor | None) -> torch.Tensor | None:
    """Which positions of a batch (`recipes.inputs.batches.model_inputs`) are real tokens, for router/aux:
    a `[B, T]` attention mask's ones; packed rows under sdpa / eager (a 4-D mask), the positions of a
    segment (`sequence_ids` > 0; segment 0 is padding); None (every position) otherwise: unpadded rows,
    and packed rows flattened for flash-attention, whose per-row segment ids no longer mark the padding
    (its padding then counts as tokens of router/aux)."""
    if attention_mask is not None and attention_mask.dim() == 2:
        return attention_mask != 0
    if attention_mask is not None and sequence_ids is not None:
        return sequence_ids != 0
    return None
