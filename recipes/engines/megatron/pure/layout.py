"""Megatron's layout rules: the run's `ParallelDims` from the megatron section, and the layouts a model's
shape cannot take (`shape_problems`). Pure: the contract asks them before any model is built, the
engine's plan (`plan.py`) prices only layouts that pass them.

Layout: world = tp x cp x pp x dp, ranks ordered tensor-parallel fastest, then context-parallel, then
data-parallel, then pipeline (Megatron's default order, tp-cp-ep-dp-pp). Expert parallelism is folded into data parallelism as megatron-core defines
it: each group of `ep` consecutive data-parallel ranks splits the experts of every MoE layer, so ep
divides the data-parallel size; the experts' own tensor-parallel size is tp.
"""

from __future__ import annotations

from recipes.parallel_dims import ParallelDims
from recipes.planning.moe import MoEShape
from recipes.planning.shape import Shape

# the recipe key of each degree, for ParallelDims' messages
DIMS_KEYS = {"tp": "megatron.tp_size", "pp": "megatron.pp_size", "ep": "megatron.ep_size", "cp": "megatron.cp_size"}


def parallel_dims(megatron, world_size: int) -> ParallelDims:
    """The layout of `world_size` ranks at a `MegatronSection`'s degrees."""
    return ParallelDims.of(world_size, tp=megatron.tp_size, pp=megatron.pp_size, vpp=megatron.virtual_pp_size,
                           sp=megatron.sequence_parallel, ep=megatron.ep_size, cp=megatron.cp_size)


def shape_problems(shape: Shape, dims: ParallelDims, grad_accum: int, moe: MoEShape | None = None) -> list[str]:
    """Errors, each naming its keys, for a layout Megatron refuses or the estimate does not cover; with
    `moe`, expert parallelism's too (recipes.planning.moe: ep divides the experts and the DP size, tp
    the experts' width)."""
    out = []
    if shape.layers % (dims.pp * dims.vpp):
        out.append(f"megatron.pp_size x megatron.virtual_pp_size: {dims.pp} x {dims.vpp} does not divide the "
                   f"model's {shape.layers} layers")
    if moe is None:
        widths = [("intermediate size", shape.intermediate)]
        if dims.ep > 1:
            out.append(f"megatron.ep_size: {dims.ep} > 1, but the model has no experts (a dense MLP)")
    else:
        widths = [("experts' intermediate size (moe_intermediate_size)" if moe.family != "mixtral" else
                   "experts' intermediate size", moe.expert_intermediate)]
        widths += [("shared expert's intermediate size", moe.shared_intermediate)] * bool(moe.shared_intermediate)
        widths += [("dense layers' intermediate size", moe.dense_intermediate)] * (moe.moe_layers < moe.layers)
        if moe.experts % dims.ep:
            out.append(f"megatron.ep_size: {dims.ep} does not divide the model's {moe.experts} experts")
        if dims.dp % dims.ep:
            out.append(f"megatron.ep_size: {dims.ep} does not divide the data-parallel size {dims.dp} = world / "
                       f"(tp x pp) (megatron-core lays the experts out as tp x ep x pp x world / (tp ep pp))")
    for what, n in (("attention heads", shape.heads), ("KV heads (query groups)", shape.kv_heads), *widths):
        if n % dims.tp:
            out.append(f"megatron.tp_size: {dims.tp} does not divide the model's {n} {what}")
    if dims.vpp > 1 and grad_accum % dims.pp:
        out.append(f"train.grad_accum: {grad_accum} micro-batches must be a multiple of megatron.pp_size "
                   f"{dims.pp} under interleaving (megatron.virtual_pp_size {dims.vpp}: Megatron's micro-batch "
                   "groups per virtual stage)")
    return out
