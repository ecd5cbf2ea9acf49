"""Mixture-of-experts backbones on the Megatron engine: which HF families convert, the megatron-core MoE
settings they need, the token dispatcher, and the router's load-balancing loss (`router/aux`).

Families (`MOE_MODEL_TYPES`): Qwen3-MoE (`qwen3_moe`: q / k norms, no shared expert, softmax over the
experts then top-k, renormalised when `norm_topk_prob`) and Mixtral (`mixtral`: softmax, top-k,
renormalised). Both route with a bias-free `[E, H]` gate and run SwiGLU experts of their own width.
Refused by name: Qwen2-MoE (a shared expert with its own sigmoid gate, not converted), Qwen3-MoE with
dense layers mixed in (`decoder_sparse_step` > 1, `mlp_only_layers`), router input jitter (HF's
Mixtral multiplies the router's input by noise in training; megatron's jitter draws differently).

HF checkpoint names (what the hub's checkpoints and transformers 5's `save_pretrained` hold, per expert):
- Qwen3-MoE: `model.layers.L.mlp.gate.weight` `[E, H]`, `model.layers.L.mlp.experts.e.{gate,up,down}_proj.weight`;
- Mixtral: `model.layers.L.block_sparse_moe.gate.weight`, `...block_sparse_moe.experts.e.{w1,w3,w2}.weight`
  (w1 the gate, w3 the up, w2 the down projection).

Megatron's layout (local spec, `SequentialMLP`, no grouped GEMM), per expert-parallel (EP) rank p of P and
tensor-parallel rank r of T (the experts' TP size is the model's): `mlp.router.weight` `[E, H]`
(replicated), and for each of the E/P experts `j` it holds (global expert `p·E/P + j`)
`mlp.experts.local_experts.j.linear_fc1.weight` `[2·F/T, H]` (`[gate_r; up_r]`) and
`...linear_fc2.weight` `[H, F/T]`. Routing is dropless (no capacity factor), as HF's.

`router/aux` (the one definition numloss uses, `recipes/training/router_loss.py` on the DeepSpeed engine):
megatron-core's per-layer switch load-balancing loss summed over the MoE layers. For a layer with T real
(non-padding) tokens in the micro-batch of one data-parallel rank (all sequence-parallel shards together),
E experts and top-k: aux_l = coeff · E / (k · T²) · Σ_e P_e · c_e, P_e the sum over the tokens of
softmax(router logits)[t, e], c_e how many of the T·k top-k choices went to e. The step's router/aux is the
mean over its micro-batches and data-parallel ranks. megatron-core 0.16.1 computes exactly this per layer
(`switch_load_balancing_loss_func`, with c_e summed over the TP group under sequence parallelism, so each
TP rank's share carries its own tokens' P_e; the shares add up to aux_l), but scales its gradient by the
micro-batch's token count under `calculate_per_token_loss` (then divided by the step's label count in
`finalize_model_grads`), which is the mean only when every micro-batch has the same count. `AuxLossScale`
attaches aux_l with the factor that makes the gradient the mean's, and records each layer's value for the
log instead of megatron's tracker.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from ..pure.support import (  # noqa: F401  (the family rules, pure: support.py)
    MOE_MODEL_TYPES,
    REFUSED_MOE_TYPES,
    check_supported_moe,
    expert_ffn_size,
    is_moe,
    num_experts,
    renormalises_top_k,
)

DISPATCHERS = ("alltoall", "allgather")
_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..+)$")


def aux_coeff(hf_config, recipe_coeff: float | None) -> float:
    """The router loss's weight: the recipe's `loss.router_aux_coeff`, else the HF config's
    `router_aux_loss_coef` (0 when it has none)."""
    if recipe_coeff is not None:
        return float(recipe_coeff)
    return float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0)


def resolve_dispatcher(choice: str, cuda: bool | None = None) -> str:
    """`megatron.moe_token_dispatcher`: "auto" is "alltoall" on CUDA (megatron's fast path: each token
    crosses the EP group once) and "allgather" on CPU (every EP rank gathers every token and keeps its
    experts'; it needs only all-gather and reduce-scatter, which gloo runs); an explicit choice is kept,
    but alltoall is refused without CUDA (megatron-core 0.16.1 builds a CUDA stream for it: tried on gloo,
    the MoE layer failed to build)."""
    if choice == "auto":
        cuda = torch.cuda.is_available() if cuda is None else cuda
        return "alltoall" if cuda else "allgather"
    if choice not in DISPATCHERS:
        raise ValueError(f"megatron.moe_token_dispatcher {choice!r}: expected auto or one of {list(DISPATCHERS)}")
    if choice == "alltoall" and not (torch.cuda.is_available() if cuda is None else cuda):
        raise ValueError("megatron.moe_token_dispatcher alltoall: needs CUDA (megatron-core 0.16.1's alltoall "
                         "dispatcher makes a torch.cuda.Stream when the MoE layer is built); use allgather or auto")
    return choice


def moe_config_kwargs(hf_config, *, ep_size: int = 1, tp_size: int = 1, sequence_parallel: bool = False,
                      dispatcher: str = "auto", router_aux_coeff: float | None = None) -> dict:
    """The TransformerConfig fields of an MoE backbone (none for a dense one). Refuses an EP size that
    does not divide the experts. Dropless: no capacity factor."""
    if not is_moe(hf_config):
        if ep_size != 1:
            raise ValueError(f"megatron.ep_size {ep_size}: the model ({hf_config.model_type}) has no experts")
        return {}
    check_supported_moe(hf_config)
    experts = num_experts(hf_config)
    if experts % ep_size:
        raise ValueError(f"megatron.ep_size {ep_size} does not divide the model's {experts} experts")
    if tp_size > 1 and not sequence_parallel:
        raise ValueError(f"megatron.sequence_parallel: an MoE model at megatron.tp_size {tp_size} needs it "
                         f"(megatron-core 0.16.1 refuses to train MoE layers under TP without SP)")
    return {"num_moe_experts": experts, "moe_ffn_hidden_size": expert_ffn_size(hf_config),
            "moe_router_topk": hf_config.num_experts_per_tok,
            "moe_router_pre_softmax": not renormalises_top_k(hf_config), "moe_router_score_function": "softmax",
            "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": aux_coeff(hf_config, router_aux_coeff),
            "moe_token_dispatcher_type": resolve_dispatcher(dispatcher), "moe_expert_capacity_factor": None,
            "moe_grouped_gemm": False, "expert_model_parallel_size": ep_size,
            "expert_tensor_parallel_size": tp_size}


# ---- names --------------------------------------------------------------------------------------------


def hf_moe_names(hf_config, layer: int) -> tuple[str, list[tuple[str, str, str]]]:
    """(router name, [(gate, up, down) per expert]) of HF layer `layer`."""
    if hf_config.model_type == "mixtral":
        base = f"model.layers.{layer}.block_sparse_moe."
        experts = [tuple(f"{base}experts.{e}.{w}.weight" for w in ("w1", "w3", "w2")) for e in range(num_experts(hf_config))]
    else:
        base = f"model.layers.{layer}.mlp."
        experts = [tuple(f"{base}experts.{e}.{p}_proj.weight" for p in ("gate", "up", "down"))
                   for e in range(num_experts(hf_config))]
    return base + "gate.weight", experts


def local_expert_range(experts: int, ep_rank: int, ep_size: int) -> range:
    """The global experts EP rank `ep_rank` holds, in local order (megatron's contiguous split)."""
    per = experts // ep_size
    return range(ep_rank * per, (ep_rank + 1) * per)


def global_expert_names(state: dict, ep_rank: int, local_experts: int) -> dict:
    """`...local_experts.<j>.x` -> `...local_experts.<ep_rank·local_experts + j>.x` (others unchanged)."""
    out = {}
    for name, value in state.items():
        m = _EXPERT.match(name)
        out[f"{m.group(1)}{ep_rank * local_experts + int(m.group(2))}{m.group(3)}" if m else name] = value
    return out


def is_expert_param(name: str) -> bool:
    return ".mlp.experts." in name


# ---- router/aux -----------------------------------------------------------------------------------------


@dataclass
class AuxLossScale:
    """The step's router/aux bookkeeping, shared by every MoE layer's router of this rank.

    `begin_step(micro_batches, dp_size, tokens)`: the gradient of each attached aux_l is multiplied by
    `tokens / (micro_batches · dp_size)` (`tokens`: the step's global label count, by which
    `finalize_model_grads` then divides every gradient), so the optimizer sees d(mean over micro-batches
    and DP ranks of Σ_l aux_l). `values`: each (micro-batch, layer) aux_l this rank computed (its TP
    share under SP), detached, for the log."""

    factor: float = 0.0
    values: list = field(default_factory=list)

    def begin_step(self, micro_batches: int, dp_size: int, tokens: float) -> None:
        self.factor = float(tokens) / (micro_batches * dp_size)
        self.values = []

    def local_sum(self) -> float:
        return float(sum(float(v) for v in self.values))


def install_aux_loss(model, scale: AuxLossScale) -> int:
    """Make every MoE router of `model` attach its load-balancing loss through `scale` (see
    `AuxLossScale`) instead of megatron's token-count scaling and tracker. Returns the routers patched.
    Local; call before the first training forward."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.moe.router import TopKRouter

    count = 0
    for module in model.modules():
        if not isinstance(module, TopKRouter):
            continue

        def attach(probs, aux_loss_coeff, aux_loss, aux_loss_name, reduce_group, reduce_group_has_dp=False,
                   valid_token_count=None, _scale=scale):
            _scale.values.append(aux_loss.detach())
            return MoEAuxLossAutoScaler.apply(probs, aux_loss * _scale.factor)

        module.attach_and_log_load_balancing_loss = attach
        count += 1
    return count


def patch_router_gemm() -> None:
    """megatron-core 0.16.1's router GEMM (`moe_utils.RouterGatingLinearFunction`) reads the module global
    `te_general_gemm`, which the module defines only when Transformer Engine imports: without TE (CPU,
    or a GPU image without it) every MoE forward raised NameError. Define it as None there, the value
    that selects megatron's own torch.mm path. Idempotent; nothing changes where TE defined it."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
