"""The DeepSpeed engine's plan of a recipe (`plan`, the contract's): its placement and ZeRO settings as the
engine makes them (recipes.engines.deepspeed.pure.config: buckets from the model's shape, hpZ across nodes,
deepspeed.overrides applied), priced by recipes.engines.deepspeed.pure.costs into a `recipes.planning.Plan`.
Also what the recommender weighs on this engine: the layouts a recipe's model and cluster could take
(`layout_candidates`) and the changes of the recipe's own layout that shorten its step (`layout_changes`),
each a `recipes.planning.plan.Candidate`. Pure: no torch, no deepspeed at module level (DeepSpeed's own
estimator, `estimator_memory`, imports it when asked).
"""

from __future__ import annotations

import os
from dataclasses import replace

from recipes.engines.deepspeed.pure.config import deepspeed_config, zero_comm_settings
from recipes.engines.deepspeed.pure import costs
from recipes.planning.backbones import count_parameters
from recipes.planning.device_memory import device_memory
from recipes.planning.placement import Placement
from recipes.planning.plan import Candidate, Plan, divisors, override
from recipes.planning.shape import Shape

ENGINE = costs.ENGINE
MAX_ROWS_PER_MICRO_BATCH = 16


def zero_settings(recipe, shape: Shape, world: int | None = None) -> tuple[Placement, costs.ZeroSettings]:
    """The recipe's placement on `world` ranks (default: its cluster's) and ZeRO settings, as
    recipes.engines.deepspeed.pure.config makes them (buckets from the model's shape when its config is not
    cached here), deepspeed.overrides applied."""
    m, ds, tr, cl = recipe.model, recipe.deepspeed, recipe.train, recipe.cluster
    ranks = cl.ranks_per_node()
    world = world or cl.nodes * ranks
    try:
        cfg = deepspeed_config(recipe, world)
        zero = cfg["zero_optimization"]
    except ValueError:  # a batch that does not divide: validate reports it in its own section
        cfg, zero = {}, {"stage": ds.zero_stage, **zero_comm_settings(recipe, world)}
    overrides = (ds.overrides or {}).get("zero_optimization", {})
    e = 2 if m.dtype == "bfloat16" else 4
    reduce_dtype = cfg.get("communication_data_type", ds.reduce_dtype if e == 2 else "fp32")
    where = costs.placement(cl.nodes if cl.gpus_per_node else 1, ranks if cl.gpus_per_node else world, ds.tp_size,
                            ds.sp_size)
    return where, costs.ZeroSettings(
        zero_stage=ds.zero_stage, hpz=int(zero.get("zero_hpz_partition_size", 1)),
        micro_batch_size=tr.micro_batch_size, grad_accum=tr.grad_accum, e=e,
        reduce_bytes=2 if reduce_dtype in ("bf16", "bfloat16", "fp16") else 4,
        checkpointing=m.gradient_checkpointing, chunked=recipe.loss.head == "chunked",
        chunk_size=recipe.loss.chunk_size, eager=m.attn_implementation == "eager",
        offload_optimizer=ds.offload_optimizer, offload_params=ds.offload_params,
        sp=ds.sp_size, prefetch_bucket=int(overrides.get("stage3_prefetch_bucket_size",
                                          max(int(0.9 * shape.hidden ** 2), shape.largest_matrix))),
        reduce_bucket=int(overrides.get("reduce_bucket_size", shape.hidden ** 2)))


def plan(recipe, model_cfg, *, hardware, rows, world_size: int | None = None, moe_imbalance: float = 1.0,
         gpus: bool = True, params: tuple[int, int] | None = None, model_states: float | None = None,
         trainable: int | None = None) -> Plan:
    """The plan of the recipe's layout on `world_size` ranks (default: its cluster's) at `rows` on
    `hardware` (recipes.planning.step_model). `params`: (total, largest module) when already counted
    (else counted from `model_cfg` on the meta device); `model_states`, `trainable`: a LoRA run's
    (costs.lora_memory_estimate). `moe_imbalance` and `gpus` change nothing here: the engine keeps every
    expert on every rank and pads its batches alike on any device. AttributeError when the config has no
    layer shapes."""
    shape = Shape.of(model_cfg)
    total, largest = params or count_parameters(model_cfg, vision=recipe.model.vision)
    where, zero = zero_settings(recipe, shape, world_size)
    return costs.estimate(shape, total, largest, where, zero, rows, hardware, model_states=model_states,
                          trainable=trainable)


def estimator_memory(recipe, total_params: int, largest_params: int) -> dict:
    """DeepSpeed's own estimate of model-state memory per GPU and per node's host (bytes), for the
    recipe's ZeRO stage, cluster, AutoTP size and offload settings (`estimate_zero3_model_states_mem_needs`
    or `..._zero2_...`: with AutoTP each TP rank's 1/T slice is the model ZeRO shards)."""
    import torch

    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    ds, cl = recipe.deepspeed, recipe.cluster
    per_rank_params = total_params // ds.tp_size
    dp_per_node = max(1, cl.gpus_per_node // ds.tp_size)
    if ds.zero_stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            total_params=per_rank_params, largest_layer_params=largest_params // ds.tp_size,
            num_gpus_per_node=dp_per_node, num_nodes=cl.nodes, cpu_offload=ds.offload_optimizer,
            cpu_offload_params=ds.offload_params, zero_init=True)
        fn = "estimate_zero3_model_states_mem_needs"
    else:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        cpu, gpu = estimate_zero2_model_states_mem_needs(
            total_params=per_rank_params, num_gpus_per_node=dp_per_node, num_nodes=cl.nodes,
            cpu_offload=ds.offload_optimizer)
        fn = "estimate_zero2_model_states_mem_needs"
    return {"gpu_bytes": int(gpu), "cpu_bytes": int(cpu), "function": fn}


# ---- what the recommender weighs -------------------------------------------------------------------------


def layout_candidates(recipe, model_cfg, *, hardware, rows, global_batch: int, params: tuple[int, int],
                      moe_imbalance: float = 1.0) -> list[Candidate]:
    """The layouts of `global_batch` rows per step on the recipe's cluster that fit `hardware.mem_gib`:
    ZeRO-2 and ZeRO-3 (hpZ at the node's ranks across nodes), TP 1, every split of a rank's rows into
    micro_batch_size x grad_accum, gradient checkpointing off when that fits, else on; DeepSpeed-Ulysses
    (`deepspeed.sp_size`) at the smallest sp (a power of two, up to the GPUs of a node, dividing the model's
    heads) at which a zero-stage's layout fits, for rows too long for one GPU. AutoTP is left out (tested
    here with ZeRO-3, not documented by DeepSpeed: docs/cluster.md). The recipe's other settings (dtype,
    head, reduce dtype, buckets) stay as they are."""
    cl = recipe.cluster
    world = cl.nodes * cl.gpus_per_node
    shape = Shape.of(model_cfg)
    total, largest = params
    where, base = zero_settings(recipe, shape, world)
    out = []
    for zero_stage in (2, 3):
        hpz = cl.gpus_per_node if zero_stage == 3 and cl.nodes > 1 else 1
        for sp in ulysses_sizes(shape, cl.gpus_per_node or 1, world):
            found = _fitting(shape, total, largest, costs.placement(where.nodes, where.gpus_per_node, 1, sp),
                             replace(base, zero_stage=zero_stage, hpz=hpz, sp=sp), rows, hardware, global_batch)
            out += found
            if found:
                break  # the smallest sp that fits: more splits the rows for nothing
    return out


def ulysses_sizes(shape: Shape, gpus_per_node: int, world: int) -> list[int]:
    """Sequence-parallel sizes to try: 1, then powers of two up to a node's GPUs that divide the world and
    the attention heads, with KV heads dividing them or divided by them (Ulysses' rules)."""
    sizes, sp = [1], 2
    while sp <= min(gpus_per_node, world):
        if world % sp == 0 and shape.heads % sp == 0 and (shape.kv_heads % sp == 0 or sp % shape.kv_heads == 0):
            sizes.append(sp)
        sp *= 2
    return sizes


def _fitting(shape, total, largest, where: Placement, base: costs.ZeroSettings, rows, hardware,
             global_batch: int) -> list[Candidate]:
    """The splits of `global_batch` rows over `where`'s data-parallel ranks that fit (checkpointing only
    where a split does not fit without it)."""
    out = []
    if global_batch % where.dp:
        return out
    for b in divisors(global_batch // where.dp, MAX_ROWS_PER_MICRO_BATCH):
        for ckpt in (False, True):
            zero = replace(base, micro_batch_size=b, grad_accum=global_batch // (where.dp * b), checkpointing=ckpt)
            pl = costs.estimate(shape, total, largest, where, zero, rows, hardware)
            if not pl.fits(hardware.mem_gib):
                continue
            split = f"sequence-parallel {zero.sp} (Ulysses), " if zero.sp > 1 else ""
            text = (f"DeepSpeed ZeRO-{zero.zero_stage}{f' + hpZ {zero.hpz}' if zero.hpz > 1 else ''}, {split}{b} row(s)"
                    f" x {zero.grad_accum} micro-batch(es) per GPU, checkpointing {'on' if ckpt else 'off'}")
            settings = [override("train.engine", ENGINE), override("deepspeed.zero_stage", zero.zero_stage),
                        override("deepspeed.tp_size", 1), override("deepspeed.sp_size", zero.sp),
                        override("train.micro_batch_size", b), override("train.grad_accum", zero.grad_accum),
                        override("model.gradient_checkpointing", ckpt)]
            out.append(Candidate(ENGINE, text, settings, pl))
            break
    return out


def layout_changes(recipe, model_cfg, *, hardware, rows, params: tuple[int, int], now: Plan) -> list[Candidate]:
    """Changes of the recipe's own layout (`now`, its plan) that the cost model says shorten the step or
    cost fewer GPU-seconds, and fit (with gradient checkpointing where only that makes one fit): one
    micro-batch per step, bf16 gradient reduction, no recompute, hpZ, TP 1 with hpZ across nodes, half
    the nodes of larger GPUs. Unordered: the recommender sorts them."""
    shape = Shape.of(model_cfg)
    total, largest = params
    lay, zero, hw = now.placement, now.settings, hardware
    tries: list[tuple[str, Placement, costs.ZeroSettings, object]] = []
    G, b = zero.grad_accum, zero.micro_batch_size
    if G > 1:
        tries.append((f"one micro-batch per step: train.micro_batch_size={b * G} "
                      "train.grad_accum=1 (ZeRO reduce-scatters every micro-batch's gradients)",
                      lay, replace(zero, micro_batch_size=b * G, grad_accum=1), hw))
        if zero.checkpointing:
            tries.append((f"one micro-batch per step without recompute: train.micro_batch_size="
                          f"{b * G} train.grad_accum=1 model.gradient_checkpointing=false",
                          lay, replace(zero, micro_batch_size=b * G, grad_accum=1, checkpointing=False), hw))
    if zero.reduce_bytes == 4 and zero.e == 2:
        tries.append(("deepspeed.reduce_dtype=bf16 (half the gradient bytes; the loss then depends on the "
                      "data-parallel size through bf16 rounding: keep fp32 for loss comparisons)",
                      lay, replace(zero, reduce_bytes=2), hw))
    if zero.checkpointing:
        tries.append(("model.gradient_checkpointing=false (no second forward)", lay,
                      replace(zero, checkpointing=False), hw))
    per_node_dp = lay.gpus_per_node // lay.tp
    if zero.zero_stage == 3 and lay.nodes > 1 and zero.hpz <= 1 and 1 < per_node_dp < lay.dp:
        tries.append((f"hpZ: zero_hpz_partition_size={per_node_dp}", lay, replace(zero, hpz=per_node_dp), hw))
    gb = b * G * lay.dp
    if lay.tp > 1 and lay.nodes > 1 and gb % lay.world == 0:
        tries.append((f"deepspeed.tp_size=1 with hpZ (TP {lay.tp} leaves one rank per node in each data-parallel"
                      f" ring: every hop crosses the network): {gb // lay.world} row(s) per rank",
                      costs.placement(lay.nodes, lay.gpus_per_node, 1),
                      replace(zero, hpz=lay.gpus_per_node, micro_batch_size=gb // lay.world, grad_accum=1), hw))
    if lay.nodes > 1 and lay.nodes % 2 == 0:
        big = replace(hw, mem_gib=max(hw.mem_gib, device_memory(141.0).usable_gib))  # an H200, less the margin
        half = costs.placement(lay.nodes // 2, lay.gpus_per_node, lay.tp)
        if gb % half.dp == 0:
            tries.append((f"fewer, larger GPUs: cluster.nodes={half.nodes} of 141 GiB GPUs (H200), "
                          f"{gb // half.dp} row(s) per rank in one micro-batch", half,
                          replace(zero, micro_batch_size=gb // half.dp, grad_accum=1), big))
    out = []
    for text, where, variant, vhw in tries:
        pl = costs.estimate(shape, total, largest, where, variant, rows, vhw)
        if not pl.fits(vhw.mem_gib):  # checkpointing may make a variant fit
            if variant.checkpointing or "checkpointing" in text:
                continue
            pl = costs.estimate(shape, total, largest, where, replace(variant, checkpointing=True), rows, vhw)
            if not pl.fits(vhw.mem_gib):
                continue
            text += " with model.gradient_checkpointing=true"
        if pl.step_s < 0.97 * now.step_s or pl.step_s * pl.world < 0.97 * (now.step_s * now.world):
            out.append(Candidate(ENGINE, text, [], pl))
    return out
