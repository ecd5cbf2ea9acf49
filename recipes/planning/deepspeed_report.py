"""recipes.planning.validate's lines for a DeepSpeed recipe: GPU memory by part, host RAM at load and
export, checkpoints on disk and their cadence, the bytes each GPU moves per step inside and across nodes,
step time, MFU, what limits it, and the changes that would shorten it (recipes.planning.budget's plan).

Host RAM per node: at load, ZeRO 0-2 with AutoTP materialise the whole model per rank (ranks/node x P x
e); otherwise each rank streams it a checkpoint shard (~5 GB) at a time (ZeRO-3 partitioned, ZeRO 0-2 at
TP 1 straight onto its GPU, recipes.engines.deepspeed.model.load_placement). At export
(recipes.engines.deepspeed.export) each rank holds its share, P x e / world + the largest module.
Checkpoint cadence: a save every train.save_every steps is that many predicted step times of training;
it writes the checkpoint at STORAGE_GBPS (an assumption: a parallel file system's aggregate write rate).
"""

from __future__ import annotations

from recipes.planning import budget as B
from recipes.planning import step_model as sm
from recipes.planning.step_model import GiB

STORAGE_GBPS = 10.0  # GB/s of aggregate checkpoint writes (an assumption, not measured)


def _gib(n_bytes: float) -> str:
    return f"{n_bytes / GiB:.1f} GiB"


def recipe_layout(recipe, shape: B.Shape, world: int | None = None) -> B.DSLayout:
    """The DSLayout of a DeepSpeed recipe: ZeRO settings as recipes.engines.deepspeed.config makes them
    (buckets from the model's shape when its config is not cached here), deepspeed.overrides applied."""
    from recipes.engines.deepspeed.config import deepspeed_config, zero_comm_settings

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
    return B.DSLayout(
        zero_stage=ds.zero_stage, tp=ds.tp_size, nodes=cl.nodes if cl.gpus_per_node else 1,
        ranks_per_node=ranks if cl.gpus_per_node else world, hpz=int(zero.get("zero_hpz_partition_size", 1)),
        micro_batch_size=tr.micro_batch_size, grad_accum=tr.grad_accum, e=e,
        reduce_bytes=2 if reduce_dtype in ("bf16", "bfloat16", "fp16") else 4,
        checkpointing=m.gradient_checkpointing, chunked=recipe.loss.head == "chunked",
        chunk_size=recipe.loss.chunk_size, eager=m.attn_implementation == "eager",
        prefetch_bucket=int(overrides.get("stage3_prefetch_bucket_size",
                                          max(int(0.9 * shape.hidden ** 2), B.layer_largest_matrix(shape)))),
        reduce_bucket=int(overrides.get("reduce_bucket_size", shape.hidden ** 2)))


def report_budget(rep, recipe, cfg, total: int, largest: int, est: dict, *, hw: sm.Hardware, rows: sm.Rows,
                  trainable: int | None = None) -> B.DSPlan | None:
    """Adds the module docstring's lines to the report `rep` (recipes.planning.validate.Report), with an
    error naming the part that does not fit (exit status 1). `est`: the model-state estimate validate
    printed (DeepSpeed's, or LoRA's); `trainable`: LoRA's adapter parameters."""
    tr = recipe.train
    try:
        shape = B.Shape.of(cfg)
    except AttributeError as err:
        rep.warnings.append(f"memory: no layer shapes in the model config ({err}); activations not estimated")
        return None
    lay = recipe_layout(recipe, shape)
    e, tp = lay.e, lay.tp
    states = est["gpu_bytes"] if trainable is not None else None
    pl = B.deepspeed_plan(shape, total, largest, lay, rows, hw, model_states=states, trainable=trainable)
    other = B.activation_bytes(shape, lay.micro_batch_size * rows.peak, tp, rows.peak, e, not lay.checkpointing,
                               lay.eager)
    mem = dict(pl.memory)
    mem[f"activations (gradient checkpointing {'on' if lay.checkpointing else 'off'})"] = mem.pop("activations")
    mem[f"head ({'chunked' if lay.chunked else 'logits'})"] = mem.pop("head")
    rep.numbers.update(activation_bytes=int(pl.memory["activations"]), head_bytes=int(pl.memory["head"]),
                       gpu_total_bytes=int(pl.total), hpz_copy_bytes=int(pl.memory.get("hpZ copy", 0)),
                       model_states_bytes=int(pl.memory["model states"]))
    rep.add("tokens per row", rows.note)
    rep.add("memory / GPU (all)", f"{_gib(pl.total)} = " + " + ".join(f"{k} {_gib(v)}" for k, v in mem.items())
            + f"; {tr.micro_batch_size} x {rows.peak} tokens per micro-batch at the longest rows; checkpointing "
            f"{'off' if lay.checkpointing else 'on'} would make activations {_gib(other)}")
    if not B.fits(pl, hw):
        big = max(mem, key=mem.get)
        with_ckpt = pl.total - pl.memory["activations"] + other
        rep.errors.append(f"memory: {_gib(pl.total)} per GPU does not fit the {hw.mem_gib:.2f} GiB a plan may fill (the GPU less 10 %, --gpu-mem-gb): "
                          + ", ".join(f"{k} {_gib(v)}" for k, v in mem.items())
                          + f"; the largest part is {big}" + (
                              f"; turn on model.gradient_checkpointing ({_gib(with_ckpt)})"
                              if not lay.checkpointing and with_ckpt <= hw.mem_gib * GiB else
                              "; turn on model.gradient_checkpointing" if "off" in big else
                              "; use loss.head: chunked" if big.startswith("head (logits") and tp == 1 else
                              "; offload, more GPUs or a smaller micro-batch"))
    _host_and_disk(rep, recipe, total, largest, est, e, tp, trainable, pl)
    _traffic_and_time(rep, recipe, shape, total, largest, lay, rows, hw, pl, trainable)
    return pl


def _host_and_disk(rep, recipe, total, largest, est, e, tp, trainable, pl) -> None:
    m, ds, tr, cl = recipe.model, recipe.deepspeed, recipe.train, recipe.cluster
    ranks = cl.ranks_per_node()
    world = cl.nodes * ranks
    model_bytes = total * e
    whole = ds.zero_stage < 3 and tp > 1  # recipes.engines.deepspeed.model.load_placement
    load = ranks * model_bytes if whole else ranks * min(model_bytes, 5 * 2**30)
    merged = trainable is None or m.lora.export_merged  # a LoRA run without it exports the adapter alone
    export = ranks * (model_bytes / world + largest * e) if merged else trainable * e
    # DeepSpeed's CPU estimate is host memory the run keeps only under offload
    offload = ds.offload_optimizer or ds.offload_params
    host = max(load, export) + (est["cpu_bytes"] if offload else 0)
    rep.numbers.update(host_load_bytes=int(load), host_export_bytes=int(export))
    rep.add("host RAM / node", f"load {_gib(load)} ({'whole model per rank' if whole else 'a shard at a time'}),"
                               f" export {_gib(export)} (rank 0 alone {_gib(model_bytes / world + largest * e)}), "
                               f"DeepSpeed CPU estimate {_gib(est['cpu_bytes'])}"
                               f"{'' if offload else ' (counted under offload only)'}")
    if cl.host_mem_gb and host > cl.host_mem_gb * 2**30:
        rep.errors.append(f"cluster.host_mem_gb: {cl.host_mem_gb:g} GiB per node is less than the "
                          f"{_gib(host)} the run needs at {'load' if load >= export else 'export'}"
                          + (" (ZeRO 0-2 with AutoTP load the whole model on every rank: use ZeRO-3)" if whole
                             else ""))
    ckpt = B.checkpoint_bytes(total if trainable is None else trainable, e, ds.zero_stage)
    exported = model_bytes if trainable is None else trainable * e + (model_bytes if m.lora.export_merged else 0)
    disk = ckpt * tr.keep_last + exported
    rep.numbers.update(disk_bytes=int(disk), checkpoint_bytes=int(ckpt))
    line = (f"{ckpt / 1e9:,.1f} GB per checkpoint ({ckpt / (total if trainable is None else trainable):.0f} bytes "
            f"per parameter) x keep_last {tr.keep_last} + export {exported / 1e9:,.1f} GB = {disk / 1e9:,.1f} GB")
    if tr.save_every and gpu_ok(recipe):
        every = tr.save_every * pl.step_s
        write = ckpt / (STORAGE_GBPS * 1e9)
        line += (f"; a save every {tr.save_every} steps = {every / 60:.1f} min of training, {write:.0f} s to write at "
                 f"{STORAGE_GBPS:g} GB/s (assumed)")
        if write > 0.1 * every:
            rep.warnings.append(f"train.save_every: {tr.save_every} steps (~{every / 60:.1f} min) writes {ckpt / 1e9:,.0f} GB "
                                f"each time (~{write:.0f} s at {STORAGE_GBPS:g} GB/s, {write / every:.0%} of the "
                                "training time): save less often")
    rep.add("disk", line)


def gpu_ok(recipe) -> bool:
    return recipe.cluster.gpus_per_node > 0


def _traffic_and_time(rep, recipe, shape, total, largest, lay, rows, hw, pl, trainable) -> None:
    rep.numbers.update(comm_inter_node_bytes=int(pl.net_bytes), comm_intra_node_bytes=int(pl.nvl_bytes),
                       step_flops=pl.flops, model_flops=pl.model_flops * lay.world, step_time_s=pl.step_s,
                       mfu=pl.mfu, t_compute_s=pl.t_compute, t_comm_s=pl.t_comm, padding_ratio=pl.padding_ratio,
                       step_parts=pl.parts, gemm_tflops=pl.rate,
                       comm_compute_ratio=pl.t_comm / pl.t_compute if pl.t_compute else float("inf"),
                       collectives={c.name: {"ring_bytes": c.ring, "net_bytes": c.net, "nvlink_bytes": c.nvl,
                                             "time_s": c.time(hw), "latency_s": c.latency_s(hw), "calls": c.calls,
                                             "messages": c.messages} for c in pl.collectives})
    parts = "; ".join(f"{c.name} x{c.calls}: {c.net / 1e9:,.1f} GB network + {c.nvl / 1e9:,.1f} GB NVLink, "
                      f"{c.time(hw):.2f} s" for c in pl.collectives)
    rep.add("comm / GPU / step", f"{pl.net_bytes / 1e9:,.1f} GB over the network + {pl.nvl_bytes / 1e9:,.1f} GB inside "
                                 f"the node{f' (hpZ {lay.hpz})' if lay.hpz > 1 else ''}, "
                                 f"{'bf16' if lay.reduce_bytes == 2 else 'fp32'} gradient reduction: {parts}")
    rep.add("step time", f"{pl.step_s:.2f} s = max(compute {pl.t_compute:.2f} s, communication {pl.t_comm:.2f} s), "
                         f"limited by {pl.limit}, MFU {pl.mfu:.1%}: {sm.dominant_terms(pl.parts, pl.step_s)}; GEMMs at "
                         f"{pl.rate:.0f} TFLOP/s; "
                         f"{pl.tokens:,.0f} real tokens per step, padding x{pl.padding_ratio:.2f}, "
                         f"{pl.tokens / pl.step_s / lay.world:,.0f} tokens/s/GPU")
    rep.add("assumptions", f"{sm.assumptions(hw, 'bfloat16' if lay.e == 2 else 'float32')}; the ZeRO collectives "
                           "overlap compute, AutoTP's all-reduces do not (recipes/planning/budget.py)")
    if trainable is not None or not gpu_ok(recipe):
        return
    tips = B.advice(shape, total, largest, lay, rows, hw, allow_bf16=lay.e == 2)
    for text, alt in tips[:4]:
        rep.add("advice", f"{text}: step {alt.step_s:.2f} s, MFU {alt.mfu:.1%}, {alt.layout.world} GPUs "
                          f"({alt.step_s * alt.layout.world:,.0f} GPU-s per step, now "
                          f"{pl.step_s * lay.world:,.0f}), {_gib(alt.total)} per GPU")
    rep.numbers["advice"] = [t for t, _ in tips]
    if pl.limit != "compute":
        rep.warnings.append(f"communication: {pl.t_comm:.2f} s per step against {pl.t_compute:.2f} s of compute, "
                            f"limited by {pl.limit}" + ("; see the advice lines" if tips else ""))
