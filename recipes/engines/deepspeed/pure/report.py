"""`recipes.validate`'s lines for a DeepSpeed recipe: DeepSpeed's own model-state estimate, then the plan's
GPU memory by part, host RAM at load and export, checkpoints on disk and their cadence, the bytes each GPU
moves per step inside and across nodes, step time, MFU, what limits it, and the changes that would shorten
it (recipes.engines.deepspeed.pure.plan; its costs: recipes.engines.deepspeed.pure.costs).

Two memory lines: `memory / GPU` is DeepSpeed's own estimator (`estimate_zero3_model_states_mem_needs` /
`..._zero2_...`, or costs.lora_memory_estimate for a LoRA run) of the model states alone, and its host-memory
figure, which is what an offloading run keeps per node; `memory / GPU (all)` is the plan, which adds what
the estimator leaves out (hpZ's copy, activations, the head, buffers) and is what must fit. The plan's
model-state part is its own formula, equal to DeepSpeed's (tests check it at every shipped recipe and
under offload), so the estimator's line is the engine authors' figure beside it, not a second input.

Host RAM per node: at load, ZeRO 0-2 with AutoTP materialise the whole model per rank (ranks/node x P x
e); otherwise each rank streams it a checkpoint shard (~5 GB) at a time (ZeRO-3 partitioned, ZeRO 0-2 at
TP 1 straight onto its GPU, recipes.engines.deepspeed.runtime.model.load_placement). At export
(recipes.engines.deepspeed.runtime.export) each rank holds its share, P x e / world + the largest module.
Checkpoint cadence: a save every train.save_every steps is that many predicted step times of training;
it writes the checkpoint at recipes.planning.save_time.STORAGE_GBPS (an assumption: a parallel file system's
aggregate write rate).
"""

from __future__ import annotations

from dataclasses import replace

from recipes.planning import step_model
from recipes.planning.plan import Plan
from recipes.planning.save_time import STORAGE_GBPS
from recipes.planning.shape import Shape
from recipes.planning.step_model import GiB, gib

from . import contract as deepspeed_contract  # (imported by contract: read at call time)
from . import costs as deepspeed_costs
from . import plan as deepspeed_plan


def add_plan(rep, recipe, cfg, total: int, largest: int, *, hw: step_model.Hardware, rows: step_model.Rows,
             adapter: int | None = None, moe_imbalance: float = 1.0) -> Plan | None:
    """The module docstring's lines, added to the report `rep`, with an error naming the part that does not
    fit (exit status 1). `adapter`: a LoRA run's adapter parameters."""
    m, ds, cl = recipe.model, recipe.deepspeed, recipe.cluster
    if adapter is None:
        est = deepspeed_plan.estimator_memory(recipe, total, largest)
    else:
        est = deepspeed_costs.lora_memory_estimate(total, largest, adapter, zero_stage=ds.zero_stage,
                                   dp=cl.nodes * cl.gpus_per_node // ds.tp_size, ranks_per_node=cl.gpus_per_node,
                                   weight_bytes=2 if m.dtype == "bfloat16" else 4,
                                   offload_optimizer=ds.offload_optimizer, offload_params=ds.offload_params)
    rep.numbers.update(gpu_mem_bytes=est["gpu_bytes"], cpu_mem_bytes=est["cpu_bytes"])
    rep.add("memory / GPU", f"{gib(est['gpu_bytes'])} model states (params + grads + optimizer; "
                            f"activations extra), {gib(est['cpu_bytes'])} CPU per node "
                            f"[{'deepspeed ' * (adapter is None)}{est['function']}, ZeRO-{ds.zero_stage}, offload "
                            f"optimizer={ds.offload_optimizer} params={ds.offload_params}]")
    try:
        pl = deepspeed_plan.plan(recipe, cfg, hardware=hw, rows=rows, params=(total, largest),
                                 model_states=est["gpu_bytes"] if adapter is not None else None, trainable=adapter)
    except AttributeError as err:
        rep.warnings.append(f"memory: no layer shapes in the model config ({err}); activations not estimated")
        return None
    _memory(rep, recipe, Shape.of(cfg), pl, rows, hw, (total, largest))
    _host_and_disk(rep, recipe, total, largest, est, adapter, pl)
    _traffic_and_time(rep, recipe, cfg, (total, largest), rows, hw, pl, adapter)
    return pl


def _memory(rep, recipe, shape: Shape, pl: Plan, rows, hw, params: tuple[int, int]) -> None:
    zero, lay = pl.settings, pl.placement
    other = deepspeed_costs.activation_bytes(shape, zero.micro_batch_size * rows.peak / lay.dims.cp, lay.tp, rows.peak,
                                             zero.e, not zero.checkpointing, zero.eager)
    mem = dict(pl.memory)
    mem[f"activations (gradient checkpointing {'on' if zero.checkpointing else 'off'})"] = mem.pop("activations")
    mem[f"head ({'chunked' if zero.chunked else 'logits'})"] = mem.pop("head")
    rep.numbers.update(activation_bytes=int(pl.memory["activations"]), head_bytes=int(pl.memory["head"]),
                       gpu_total_bytes=int(pl.total), hpz_copy_bytes=int(pl.memory.get("hpZ copy", 0)),
                       model_states_bytes=int(pl.memory["model states"]))
    rep.add("tokens per row", rows.note)
    rep.add("memory / GPU (all)", f"{gib(pl.total)} = " + " + ".join(f"{k} {gib(v)}" for k, v in mem.items())
            + f"; {recipe.train.micro_batch_size} x {rows.peak} tokens per micro-batch at the longest rows; "
            f"checkpointing {'off' if zero.checkpointing else 'on'} would make activations {gib(other)}")
    if not pl.fits(hw.mem_gib):
        big = max(mem, key=mem.get)
        with_ckpt = pl.total - pl.memory["activations"] + other
        rep.errors.append(f"memory: {gib(pl.total)} per GPU does not fit the {hw.mem_gib:.2f} GiB a plan may fill "
                          "(the GPU less 10 %, --gpu-mem-gb): " + ", ".join(f"{k} {gib(v)}" for k, v in mem.items())
                          + f"; the largest part is {big}" + (
                              f"; turn on model.gradient_checkpointing ({gib(with_ckpt)})"
                              if not zero.checkpointing and with_ckpt <= hw.mem_gib * GiB else
                              "; turn on model.gradient_checkpointing" if "off" in big else
                              "; use loss.head: chunked" if big.startswith("head (logits") and lay.tp == 1 else
                              "; offload, more GPUs or a smaller micro-batch") + _row_split(shape, pl, rows, hw, params))


def _row_split(shape: Shape, pl: Plan, rows, hw, params: tuple[int, int]) -> str:
    """For a plan that does not fit: the smallest DeepSpeed-Ulysses size (`deepspeed.sp_size`) at which each
    row's positions split over that many GPUs fit, with its memory and step; empty when none does (or AutoTP)."""
    lay, zero = pl.placement, pl.settings
    if lay.tp > 1:
        return ""
    for sp in deepspeed_plan.ulysses_sizes(shape, lay.gpus_per_node, lay.world):
        if sp <= lay.dims.cp:
            continue
        where = deepspeed_costs.placement(lay.nodes, lay.gpus_per_node, 1, sp)
        variant = replace(zero, sp=sp)
        split = deepspeed_costs.estimate(shape, *params, where, variant, rows, hw)
        if split.fits(hw.mem_gib):
            return (f"; or split each row over {sp} GPUs: deepspeed.sp_size={sp} fits ({gib(split.total)} per GPU, "
                    f"{split.step_s:.2f} s per step; data-parallel {where.dp}: rows per step = micro_batch_size x "
                    f"grad_accum x {where.dp})")
    return ""


def _host_and_disk(rep, recipe, total, largest, est, trainable, pl: Plan) -> None:
    m, ds, tr, cl = recipe.model, recipe.deepspeed, recipe.train, recipe.cluster
    e, tp = pl.settings.e, pl.placement.tp
    ranks = cl.ranks_per_node()
    world = cl.nodes * ranks
    model_bytes = total * e
    whole = ds.zero_stage < 3 and tp > 1  # recipes.engines.deepspeed.runtime.model.load_placement
    load = ranks * model_bytes if whole else ranks * min(model_bytes, 5 * 2**30)
    merged = trainable is None or m.lora.export_merged  # a LoRA run without it exports the adapter alone
    export = ranks * (model_bytes / world + largest * e) if merged else trainable * e
    # DeepSpeed's CPU estimate is host memory the run keeps only under offload
    offload = ds.offload_optimizer or ds.offload_params
    host = max(load, export) + (est["cpu_bytes"] if offload else 0)
    rep.numbers.update(host_load_bytes=int(load), host_export_bytes=int(export))
    rep.add("host RAM / node", f"load {gib(load)} ({'whole model per rank' if whole else 'a shard at a time'}),"
                               f" export {gib(export)} (rank 0 alone {gib(model_bytes / world + largest * e)}), "
                               f"DeepSpeed CPU estimate {gib(est['cpu_bytes'])}"
                               f"{'' if offload else ' (counted under offload only)'}")
    if cl.host_mem_gb and host > cl.host_mem_gb * 2**30:
        rep.errors.append(f"cluster.host_mem_gb: {cl.host_mem_gb:g} GiB per node is less than the "
                          f"{gib(host)} the run needs at {'load' if load >= export else 'export'}"
                          + (" (ZeRO 0-2 with AutoTP load the whole model on every rank: use ZeRO-3)" if whole
                             else ""))
    ckpt = pl.checkpoint_bytes
    exported = model_bytes if trainable is None else trainable * e + (model_bytes if m.lora.export_merged else 0)
    disk = ckpt * tr.keep_last + exported
    rep.numbers.update(disk_bytes=int(disk), checkpoint_bytes=int(ckpt))
    line = (f"{ckpt / 1e9:,.1f} GB per checkpoint ({ckpt / (total if trainable is None else trainable):.0f} bytes "
            f"per parameter) x keep_last {tr.keep_last} + export {exported / 1e9:,.1f} GB = {disk / 1e9:,.1f} GB")
    if tr.save_every and cl.gpus_per_node > 0:
        every = tr.save_every * pl.step_s
        write = ckpt / (STORAGE_GBPS * 1e9)
        line += (f"; a save every {tr.save_every} steps = {every / 60:.1f} min of training, {write:.0f} s to write at "
                 f"{STORAGE_GBPS:g} GB/s (assumed)")
        if write > 0.1 * every:
            rep.warnings.append(f"train.save_every: {tr.save_every} steps (~{every / 60:.1f} min) writes {ckpt / 1e9:,.0f} GB "
                                f"each time (~{write:.0f} s at {STORAGE_GBPS:g} GB/s, {write / every:.0%} of the "
                                "training time): save less often")
    rep.add("disk", line)


def _traffic_and_time(rep, recipe, cfg, params, rows, hw, pl: Plan, trainable) -> None:
    zero, lay = pl.settings, pl.placement
    rep.numbers.update(comm_inter_node_bytes=int(pl.net_bytes), comm_intra_node_bytes=int(pl.nvlink_bytes),
                       step_flops=pl.flops, model_flops=pl.model_flops, step_time_s=pl.step_s,
                       mfu=pl.mfu, t_compute_s=pl.t_compute, t_comm_s=pl.t_comm, padding_ratio=pl.padding_ratio,
                       step_parts=pl.parts, gemm_tflops=pl.rate,
                       comm_compute_ratio=pl.t_comm / pl.t_compute if pl.t_compute else float("inf"),
                       collectives={c.name: {"ring_bytes": c.ring, "net_bytes": c.net, "nvlink_bytes": c.nvl,
                                             "time_s": c.time(hw), "latency_s": c.latency_s(hw), "calls": c.calls,
                                             "messages": c.messages} for c in pl.collectives})
    parts = "; ".join(f"{c.name} x{c.calls}: {c.net / 1e9:,.1f} GB network + {c.nvl / 1e9:,.1f} GB NVLink, "
                      f"{c.time(hw):.2f} s" for c in pl.collectives)
    rep.add("comm / GPU / step", f"{pl.net_bytes / 1e9:,.1f} GB over the network + {pl.nvlink_bytes / 1e9:,.1f} GB "
                                 f"inside the node{f' (hpZ {zero.hpz})' if zero.hpz > 1 else ''}, "
                                 f"{'bf16' if zero.reduce_bytes == 2 else 'fp32'} gradient reduction: {parts}")
    rep.add("step time", f"{pl.step_s:.2f} s = max(compute {pl.t_compute:.2f} s, communication {pl.t_comm:.2f} s), "
                         f"limited by {pl.limit}, MFU {pl.mfu:.1%}: {step_model.dominant_terms(pl.parts, pl.step_s)}; "
                         f"GEMMs at {pl.rate:.0f} TFLOP/s; "
                         f"{pl.tokens:,.0f} real tokens per step, padding x{pl.padding_ratio:.2f}, "
                         f"{pl.tokens / pl.step_s / lay.world:,.0f} tokens/s/GPU")
    rep.add("assumptions", f"{step_model.assumptions(hw, 'bfloat16' if zero.e == 2 else 'float32')}; the ZeRO "
                           "collectives overlap compute, AutoTP's all-reduces do not (recipes/engines/deepspeed/pure/costs.py)")
    if trainable is not None or recipe.cluster.gpus_per_node <= 0:
        return
    # the changes of the recipe's own layout that shorten its step: fewest GPU-seconds per step first
    tips = sorted(deepspeed_plan.layout_changes(recipe, cfg, hardware=hw, rows=rows, params=params, now=pl),
                  key=lambda c: c.plan.step_s * c.plan.world)
    for tip in tips[:4]:
        alt = tip.plan
        rep.add("advice", f"{tip.text}: step {alt.step_s:.2f} s, MFU {alt.mfu:.1%}, {alt.world} GPUs "
                          f"({alt.step_s * alt.world:,.0f} GPU-s per step, now "
                          f"{pl.step_s * lay.world:,.0f}), {gib(alt.total)} per GPU")
    rep.numbers["advice"] = [t.text for t in tips]
    if pl.limit != "compute":
        rep.warnings.append(f"communication: {pl.t_comm:.2f} s per step against {pl.t_compute:.2f} s of compute, "
                            f"limited by {pl.limit}" + ("; see the advice lines" if tips else ""))


# ---- section 5 of validate: the layout ---------------------------------------------------------------------


def layout_line(rep, recipe, cfg) -> tuple[int, str]:
    """validate's section 5 for DeepSpeed recipes: the layout and data-parallel size, with the refusal of
    a TP group across nodes, and AutoTP's refusals and warnings for the model (`cfg`: None when the model
    was not sized)."""
    ds, cl = recipe.deepspeed, recipe.cluster
    per_node = cl.ranks_per_node()
    unit = "GPU(s)" if cl.gpus_per_node else "CPU rank(s)"
    if per_node > 0 and per_node % ds.tp_size:
        key = "cluster.gpus_per_node" if cl.gpus_per_node else "cluster.cpu_ranks_per_node"
        rep.refuse_layout([f"deepspeed.tp_size: {ds.tp_size} does not divide {key} {per_node} "
                           "(a TP group must stay inside a node)"])
    if per_node > 0 and ds.sp_size > 1 and per_node % ds.sp_size:
        key = "cluster.gpus_per_node" if cl.gpus_per_node else "cluster.cpu_ranks_per_node"
        rep.refuse_layout([f"deepspeed.sp_size: {ds.sp_size} does not divide {key} {per_node} (Ulysses' all-to-alls "
                           "of every layer stay inside a node)"])
    dp = max(1, cl.nodes * per_node // (ds.tp_size * ds.sp_size))
    if ds.tp_size > 1:
        _autotp(rep, recipe, cfg)
    split = f", sequence-parallel {ds.sp_size} (Ulysses)" if ds.sp_size > 1 else ""
    return dp, (f"{cl.nodes} node(s) x {per_node} {unit}, TP {ds.tp_size}{split}, data-parallel {dp}, "
                f"ZeRO-{ds.zero_stage}")


def _autotp(rep, recipe, cfg) -> None:
    ds, m = recipe.deepspeed, recipe.model
    if cfg is not None:
        problem = deepspeed_contract.autotp_problem(cfg, ds.tp_size, ds.zero_stage)
        kv = getattr(getattr(cfg, "text_config", None) or cfg, "num_key_value_heads", None)
        if problem:
            rep.errors.append(problem)
        elif kv is not None and kv < ds.tp_size:
            rep.warnings.append(f"deepspeed.tp_size: {kv} KV heads < tp_size {ds.tp_size}: attention runs on "
                                f"{kv} of the {ds.tp_size} TP ranks only")
    if ds.zero_stage == 3:
        rep.warnings.append("deepspeed: AutoTP + ZeRO-3 is tested here on CPU (docs/cluster.md), not "
                            "documented by DeepSpeed, which documents AutoTP training with ZeRO 0-2")
    if m.vision:
        rep.warnings.append("deepspeed.tp_size > 1 with a vision model: AutoTP would also shard the vision "
                            "tower; vision training is tested with ZeRO-3 and tp_size 1 only")
