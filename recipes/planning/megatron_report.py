"""recipes.planning.validate's lines for a Megatron recipe (`train.engine: megatron`): the recipe's layout
and the errors it has before the model's shape is known, then memory by pipeline stage, the bubble, the
bytes each GPU moves inside and across nodes, and the step time with what it is made of
(recipes.planning.megatron_budget's plan; every formula in its docstring)."""

from __future__ import annotations

from dataclasses import replace

from recipes.planning import step_model as sm
from recipes.planning.budget import GiB, Shape
from recipes.planning.megatron_budget import GRAD_BYTES, Plan, layers_in_flight, model_flags, plan
from recipes.planning.megatron_layout import Layout, groups, layout_problems, span
from recipes.planning.step_model import FIXED_BUFFER_GIB, Hardware


def layout_of(recipe) -> tuple[Layout, list[str]]:
    """The recipe's layout and the errors it has before the model's shape is known (keys named)."""
    mg, cl = recipe.megatron, recipe.cluster
    per_node = cl.ranks_per_node()
    world = cl.nodes * per_node
    errors = []
    if world % (mg.tp_size * mg.pp_size):
        errors.append(f"megatron.tp_size x megatron.pp_size: {mg.tp_size} x {mg.pp_size} = {mg.tp_size * mg.pp_size}"
                      f" does not divide cluster.nodes x cluster.gpus_per_node = {cl.nodes} x {per_node} = {world} "
                      "(data-parallel size = world / (tp x pp))")
    if per_node > 0 and per_node % mg.tp_size:
        key = "cluster.gpus_per_node" if cl.gpus_per_node else "cluster.cpu_ranks_per_node"
        errors.append(f"megatron.tp_size: {mg.tp_size} does not divide {key} {per_node}: a TP group would span "
                      "nodes (its all-reduces run every layer: keep TP inside a node)")
    if mg.sequence_parallel and mg.tp_size == 1:
        errors.append("megatron.sequence_parallel: needs megatron.tp_size > 1")
    vpp = mg.virtual_pp_size or 1
    if mg.virtual_pp_size is not None and (mg.pp_size < 2 or vpp < 2):
        errors.append(f"megatron.virtual_pp_size: {mg.virtual_pp_size} needs megatron.pp_size >= 2 and a value >= 2 "
                      "(null: no interleaving)")
        vpp = 1
    dp = max(1, world // (mg.tp_size * mg.pp_size))
    ep = getattr(mg, "ep_size", 1)
    if ep > 1 and per_node > 0 and world % (mg.tp_size * mg.pp_size) == 0 and dp % ep:
        errors.append(f"megatron.ep_size: {ep} does not divide the data-parallel size {dp} = world / (tp x pp) "
                      f"(megatron-core lays the experts out as tp x ep x pp x world / (tp ep pp))")
    return Layout(mg.tp_size, mg.pp_size, dp, vpp, mg.sequence_parallel and mg.tp_size > 1,
                  max(1, per_node), ep=ep), errors


def megatron_layout(rep, recipe) -> tuple[int, str]:
    """validate's section 5 for Megatron recipes: errors on rep; (data-parallel size, layout line)."""
    lay, errors = layout_of(recipe)
    rep.refuse_layout(errors)
    mg, cl = recipe.megatron, recipe.cluster
    unit = "GPU(s)" if cl.gpus_per_node else "CPU rank(s)"
    inter = f", interleaved x {lay.vpp}" if lay.vpp > 1 else ""
    experts = f" (EP {lay.ep} x expert-DP {lay.edp})" if lay.ep > 1 else ""
    text = (f"{cl.nodes} node(s) x {cl.ranks_per_node()} {unit}, Megatron TP {lay.tp}{' + SP' if lay.sp else ''} "
            f"x PP {lay.pp}{inter} x DP {lay.dp}{experts}, {'distributed' if mg.distributed_optimizer else 'replicated'} "
            f"optimizer, recompute {mg.recompute or 'none'}")
    return lay.dp, text


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def recipe_plan(recipe, cfg, shape: Shape, lay: Layout, *, rows: sm.Rows, hw: Hardware, moe=None,
                thd: bool | None = None, **changes) -> Plan:
    """`plan` with everything the recipe and the model's config decide (tied embeddings, q / k / v biases,
    Qwen3's q / k norms, recompute, the optimizer, overlaps, the head, the dtype, `moe`'s experts): the one
    prediction `recipes.validate` reports and a run's log sets beside what it measured. `thd`: the TE spec's
    packed form (default: unless megatron.transformer_impl is local; a run passes whether it has GPUs).
    `changes`: `plan` arguments that differ from the recipe's (another recompute, `timed`)."""
    mg = recipe.megatron
    tied, qkv_bias, qk_norm = model_flags(cfg)  # qkv_bias: qwen2, qwen2_moe; qk_norm: Qwen3's q / k norms
    return plan(shape, lay, **{
        "micro_batch_size": recipe.train.micro_batch_size, "rows": rows, "grad_accum": recipe.train.grad_accum,
        "tied": tied, "recompute": mg.recompute, "distributed_optimizer": mg.distributed_optimizer,
        "overlap_grad_reduce": mg.overlap_grad_reduce, "overlap_param_gather": mg.overlap_param_gather,
        "chunked_head": recipe.loss.head == "chunked", "chunk_size": recipe.loss.chunk_size,
        "qkv_bias": qkv_bias, "qk_norm": qk_norm, "hw": hw, "e": 2 if recipe.model.dtype == "bfloat16" else 4,
        "thd": mg.transformer_impl != "local" if thd is None else thd, "moe": moe, **changes})


def report_megatron(rep, recipe, cfg, total: int, *, hw: Hardware, rows: sm.Rows, moe_imbalance: float = 1.0
                    ) -> Plan | None:
    """Memory by stage, bubble, traffic and step time of a Megatron recipe, added to `rep`; an error when
    the peak stage does not fit `hw.mem_gib` or the layout does not divide the model. Memory at the
    longest rows, time at the rows as the engine pads them (recipes.planning.step_model.Rows.deal).
    `moe_imbalance`: an MoE model's routing imbalance (recipes.planning.moe, MoEShape.imbalance)."""
    from recipes.planning.moe import MoEShape

    mg, tr, m = recipe.megatron, recipe.train, recipe.model
    lay, _ = layout_of(recipe)  # its own errors are megatron_layout's (section 5)
    try:
        shape = Shape.of(cfg)
    except AttributeError as err:
        rep.warnings.append(f"memory: no layer shapes in the model config ({err}); Megatron plan not estimated")
        return None
    try:
        moe = MoEShape.of(cfg)
        if moe is not None:
            moe = replace(moe, imbalance=moe_imbalance)
    except ValueError as err:
        rep.errors.append(str(err))
        return None
    if moe is None and moe_imbalance != 1:
        rep.warnings.append(f"--moe-imbalance {moe_imbalance:g}: the model has no experts; ignored")
    problems = layout_problems(shape, lay, tr.grad_accum, moe)
    rep.refuse_layout(problems)
    if problems or lay.world != recipe.cluster.nodes * recipe.cluster.gpus_per_node or lay.gpus_per_node % lay.tp:
        return None
    seq = rows.peak
    e = 2 if m.dtype == "bfloat16" else 4
    pl = recipe_plan(recipe, cfg, shape, lay, rows=rows, hw=hw, moe=moe)
    peak = pl.peak
    first, last = pl.stages[0], pl.stages[-1]
    busiest = max(pl.stages, key=lambda st: st.pp_inter + st.dp_inter)
    per_param = f"{2 + GRAD_BYTES} + 12/{lay.dp}" if mg.distributed_optimizer else "18"
    rep.numbers.update(gpu_mem_bytes=int(peak.memory["model states"]), gpu_total_bytes=int(peak.total),
                       activation_bytes=int(peak.memory["activations"]), head_bytes=int(last.memory["head"]),
                       first_stage_activation_bytes=int(first.memory["activations"]),
                       peak_stage=peak.index, bubble=pl.bubble, step_time_s=pl.step_s, mfu=pl.mfu,
                       step_flops=pl.stages[0].flops_mb * tr.grad_accum, model_flops=pl.model_flops,
                       padding_ratio=pl.padding_ratio, step_parts=pl.parts, gemm_tflops=pl.rate,
                       comm_inter_node_bytes=int(busiest.pp_inter + busiest.dp_inter),
                       comm_intra_node_bytes=int(busiest.tp_bytes + busiest.pp_intra + busiest.dp_intra))
    rep.add("memory / GPU (all)", f"peak stage {peak.index} of {lay.pp}: {_gib(peak.total)} = "
            + " + ".join(f"{k} {_gib(v)}" for k, v in peak.memory.items())
            + f"; model states {_gib(peak.memory['model states'])} = {peak.params / 1e9:.2f}B parameters x "
            f"({per_param}) bytes; {tr.micro_batch_size} x {seq} tokens per micro-batch at the longest rows")
    rep.add("tokens per row", rows.note)
    if moe is not None:
        _report_experts(rep, cfg, moe, pl, lay, e)
    if lay.pp > 1:
        rep.add("memory by stage", ", ".join(f"{st.index}: {_gib(st.total)}" for st in pl.stages)
                + f" (first stage holds {layers_in_flight(lay, shape.layers, tr.grad_accum, 0):g} layer-micro-batches"
                f" of activations, last {layers_in_flight(lay, shape.layers, tr.grad_accum, lay.pp - 1):g})")
    rec = {None: "none", "selective": "selective", "full": "full"}
    other = "full" if mg.recompute != "full" else None
    alt = recipe_plan(recipe, cfg, shape, lay, rows=rows, hw=hw, moe=moe, recompute=other, timed=False)
    rep.add("activations", f"{_gib(first.memory['activations'])} on the first stage with recompute "
                           f"{rec[mg.recompute]}; recompute {rec[other]} would make it "
                           f"{_gib(alt.stages[0].memory['activations'])}")
    rep.add("pipeline", f"{tr.grad_accum} micro-batches per step per DP rank, bubble {pl.bubble:.1%} of the step"
                        + (f" ((p-1)/v = {(lay.pp - 1) / lay.vpp:g} idle micro-batch slots)" if lay.pp > 1 else ""))
    rep.add("comm / GPU / step", f"stage {busiest.index}: {(busiest.pp_inter + busiest.dp_inter) / 1e9:,.2f} GB over "
            f"the network (PP {busiest.pp_inter / 1e9:,.2f} + DP {busiest.dp_inter / 1e9:,.2f}) + "
            f"{(busiest.tp_bytes + busiest.pp_intra + busiest.dp_intra) / 1e9:,.1f} GB over NVLink (TP"
            f"{' with SP' if lay.sp else ''} {busiest.tp_bytes / 1e9:,.1f} + PP {busiest.pp_intra / 1e9:,.2f} + DP "
            f"{busiest.dp_intra / 1e9:,.2f}); DP group {pl.dp_ring}, PP group {pl.pp_ring}; rank order tp-dp-pp "
            f"(megatron-core's default); grads reduced in fp32")
    slow = max(pl.stages, key=lambda st: st.t_mb)
    rep.add("step time", f"{pl.step_s:.2f} s, MFU {pl.mfu:.1%}: {sm.dominant_terms(pl.parts, pl.step_s)}; a typical "
            f"micro-batch on stage {slow.index} {slow.t_mb * 1e3:.1f} ms (compute {slow.t_compute * 1e3:.1f} ms, GEMMs "
            f"at {pl.rate:.0f} TFLOP/s, + TP {slow.t_tp * 1e3:.1f} ms + p2p {slow.t_p2p * 1e3:.2f} ms) x ("
            f"{tr.grad_accum} + {(lay.pp - 1) / lay.vpp:g}); {pl.tokens:,.0f} real tokens per step, padding x"
            f"{pl.padding_ratio:.2f}, {pl.tokens / pl.step_s / lay.world:,.0f} tokens/s/GPU")
    rep.add("assumptions", f"{sm.assumptions(hw, 'bfloat16' if e == 2 else 'float32')}; TP not overlapped, p2p on "
            f"the critical path, DP overlapped with the last micro-batch's backward / the next first forward "
            f"(overlap_grad_reduce {mg.overlap_grad_reduce}, overlap_param_gather {mg.overlap_param_gather}); "
            f"fused attention; {FIXED_BUFFER_GIB:g} GiB fixed buffers (recipes/planning/megatron_budget.py)")
    if recipe.loss.head == "chunked":
        rep.warnings.append("loss.head: chunked: the Megatron engine computes the objective on GPTModel's "
                            "vocab-parallel logits (loss.head: logits); estimated with the chunked head as asked")
    if m.gradient_checkpointing:
        rep.warnings.append("model.gradient_checkpointing: not used by the Megatron engine; megatron.recompute is")
    if lay.pp > 1 and tr.grad_accum < lay.pp:
        rep.warnings.append(f"train.grad_accum: {tr.grad_accum} micro-batches for {lay.pp} pipeline stages: the "
                            f"bubble is {pl.bubble:.0%} of the step")
    if peak.total > hw.mem_gib * GiB:
        big = max(peak.memory, key=peak.memory.get)
        rep.errors.append(f"memory: stage {peak.index} needs {_gib(peak.total)} per GPU, more than the {hw.mem_gib:.2f} "
                          f"GiB a plan may fill (the GPU less 10 %, --gpu-mem-gb): " + ", ".join(f"{k} {_gib(v)}" for k, v in peak.memory.items())
                          + f"; the largest part is {big}" + (
                              "; set megatron.recompute (selective, full) or megatron.sequence_parallel" if big ==
                              "activations" else "; more TP / PP" + (" / EP" if moe is not None else "")
                              + ", or megatron.distributed_optimizer"))
    return pl


def _report_experts(rep, cfg, moe, pl: Plan, lay: Layout, e: int) -> None:
    """The MoE lines (recipes.planning.moe): total and active parameters, the experts a GPU holds and
    their states over the expert-data-parallel group, the all-to-all bytes and where the EP group sits."""
    from recipes.planning.moe import parameter_counts

    counts = parameter_counts(cfg)
    peak = pl.peak
    share = moe.busiest_share(lay.ep)
    rep.numbers.update(total_params=counts.total, active_params=counts.active, expert_params=counts.experts,
                       expert_state_bytes=int(peak.memory.get("expert states", 0)),
                       ep_inter_node_bytes=int(peak.ep_inter), ep_intra_node_bytes=int(peak.ep_intra),
                       moe_imbalance=moe.imbalance, moe_busiest_share=share,
                       expert_activation_bytes=int(peak.expert_activations))
    rep.add("experts", f"{moe.family}: {moe.experts} experts, top-{moe.top_k}, width {moe.expert_intermediate}"
            f"{f', shared expert {moe.shared_intermediate}' if moe.shared_intermediate else ''} in {moe.moe_layers} of "
            f"{moe.layers} layers; {counts.total / 1e9:.2f}B parameters, {counts.active / 1e9:.2f}B active per token "
            f"(routed experts {counts.experts / 1e9:.2f}B); FLOPs per token from the active ones")
    if lay.ep > 1:
        nodes, _ = span(lay, groups(lay, "dp")[0][:lay.ep])
        where = "inside a node" if nodes == 1 else f"across {nodes} nodes"
    else:
        where = "no EP"
    rep.add("expert parallel", f"EP {lay.ep} ({where}): {moe.experts // lay.ep} experts per GPU of each MoE layer, "
            f"{peak.expert_params / 1e9:.2f}B expert parameters on the peak stage, their states "
            f"{peak.memory.get('expert states', 0) / GiB:.1f} GiB over expert-DP {lay.edp}; all-to-all per step "
            f"{(peak.ep_inter + peak.ep_intra) / 1e9:,.2f} GB ({peak.ep_inter / 1e9:,.2f} over the network), "
            f"{peak.t_ep * 1e3:.1f} ms per micro-batch on the critical path; {_routing(moe, share, peak, lay)}")


def _routing(moe, share: float, peak, lay: Layout) -> str:
    """The routing the expert numbers assume (recipes.planning.moe: routing imbalance)."""
    acts = f"expert activations {_gib(peak.expert_activations)}"
    if moe.imbalance == 1:
        return f"balanced routing assumed (--moe-imbalance 1: each EP rank receives the mean tokens), {acts}"
    if share == 1:
        return f"routing imbalance x{moe.imbalance:g} has no effect at EP 1 (every GPU runs its own tokens' experts)"
    capped = (f", capped at x{share:g}: all the tokens its {moe.experts // lay.ep} experts can take"
              if share < moe.imbalance else "")
    return (f"routing imbalance x{moe.imbalance:g} (--moe-imbalance): the busiest EP rank receives x{share:g} the mean "
            f"tokens{capped}; its {acts} (+{_gib(peak.expert_activations * (1 - 1 / share))} over balanced), its "
            f"all-to-all bytes and expert GEMMs x{share:g}")
