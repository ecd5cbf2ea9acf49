"""`recipes.validate`'s lines for a Megatron recipe (`train.engine: megatron`): the recipe's layout and the
errors it has before the model's shape is known, then memory by pipeline stage, the bubble, the bytes
each GPU moves inside and across nodes, and the step time with what it is made of
(recipes.engines.megatron.pure.plan; its costs and every formula: recipes.engines.megatron.pure.costs)."""

from __future__ import annotations

from recipes.planning import step_model
from recipes.planning.moe import parameter_counts
from recipes.planning.placement import Placement, groups, span
from recipes.planning.plan import Plan
from recipes.planning.shape import Shape
from recipes.planning.step_model import FIXED_BUFFER_GIB, GiB, Hardware, gib

from .costs import GRAD_BYTES, layers_in_flight
from . import plan as megatron_plan
from .layout import shape_problems


def layout_line(rep, recipe, cfg) -> tuple[int, str]:
    """validate's section 5 for Megatron recipes: errors on rep; (data-parallel size, layout line). The
    rules that need the model (`cfg`) are the static checks' (recipes.checks)."""
    lay = megatron_plan.placement(recipe)
    rep.refuse_layout(megatron_plan.cluster_problems(recipe))
    mg, cl = recipe.megatron, recipe.cluster
    unit = "GPU(s)" if cl.gpus_per_node else "CPU rank(s)"
    inter = f", interleaved x {lay.vpp}" if lay.vpp > 1 else ""
    experts = f" (EP {lay.ep} x expert-DP {lay.edp})" if lay.ep > 1 else ""
    text = (f"{cl.nodes} node(s) x {cl.ranks_per_node()} {unit}, Megatron TP {lay.tp}{' + SP' if lay.sp else ''} "
            f"x PP {lay.pp}{inter} x DP {lay.dp}{experts}, {'distributed' if mg.distributed_optimizer else 'replicated'} "
            f"optimizer, recompute {mg.recompute or 'none'}")
    return lay.dp, text


def add_plan(rep, recipe, cfg, total: int, largest: int, *, hw: Hardware, rows: step_model.Rows,
             adapter: int | None = None, moe_imbalance: float = 1.0) -> Plan | None:
    """Memory by stage, bubble, traffic and step time of a Megatron recipe, added to `rep`; an error when
    the peak stage does not fit `hw.mem_gib` or the layout does not divide the model. Memory at the
    longest rows, time at the rows as the engine pads them (recipes.planning.step_model.Rows.deal).
    `moe_imbalance`: an MoE model's routing imbalance (recipes.planning.moe, MoEShape.imbalance)."""
    mg, tr, m = recipe.megatron, recipe.train, recipe.model
    lay = megatron_plan.placement(recipe)  # its own errors are layout_line's (section 5)
    try:
        shape = Shape.of(cfg)
    except AttributeError as err:
        rep.warnings.append(f"memory: no layer shapes in the model config ({err}); Megatron plan not estimated")
        return None
    try:
        moe = megatron_plan.experts(cfg, moe_imbalance)
    except ValueError as err:
        rep.errors.append(str(err))
        return None
    if moe is None and moe_imbalance != 1:
        rep.warnings.append(f"--moe-imbalance {moe_imbalance:g}: the model has no experts; ignored")
    problems = shape_problems(shape, lay.dims, tr.grad_accum, moe)
    rep.refuse_layout(problems)
    if problems or not lay.dims.divides or lay.gpus_per_node % lay.tp:
        return None
    seq = rows.peak
    e = 2 if m.dtype == "bfloat16" else 4
    pl = megatron_plan.plan(recipe, cfg, hardware=hw, rows=rows, moe=moe)
    peak = pl.peak
    first, last = pl.stages[0], pl.stages[-1]
    busiest = max(pl.stages, key=lambda st: st.pp_inter + st.dp_inter)
    per_param = f"{2 + GRAD_BYTES} + 12/{lay.dp}" if mg.distributed_optimizer else "18"
    rep.numbers.update(gpu_mem_bytes=int(peak.memory["model states"]), gpu_total_bytes=int(pl.total),
                       activation_bytes=int(peak.memory["activations"]), head_bytes=int(last.memory["head"]),
                       first_stage_activation_bytes=int(first.memory["activations"]),
                       peak_stage=peak.index, bubble=pl.bubble, step_time_s=pl.step_s, mfu=pl.mfu,
                       step_flops=pl.flops, model_flops=pl.model_flops,
                       padding_ratio=pl.padding_ratio, step_parts=pl.parts, gemm_tflops=pl.rate,
                       comm_inter_node_bytes=int(pl.net_bytes), comm_intra_node_bytes=int(pl.nvlink_bytes))
    rep.add("memory / GPU (all)", f"peak stage {peak.index} of {lay.pp}: {gib(pl.total)} = "
            + " + ".join(f"{k} {gib(v)}" for k, v in pl.memory.items())
            + f"; model states {gib(peak.memory['model states'])} = {peak.params / 1e9:.2f}B parameters x "
            f"({per_param}) bytes; {tr.micro_batch_size} x {seq} tokens per micro-batch at the longest rows")
    rep.add("tokens per row", rows.note)
    if moe is not None:
        _report_experts(rep, cfg, moe, pl, lay)
    if lay.pp > 1:
        rep.add("memory by stage", ", ".join(f"{st.index}: {gib(st.total)}" for st in pl.stages)
                + f" (first stage holds {layers_in_flight(lay, shape.layers, tr.grad_accum, 0):g} layer-micro-batches"
                f" of activations, last {layers_in_flight(lay, shape.layers, tr.grad_accum, lay.pp - 1):g})")
    rec = {None: "none", "selective": "selective", "full": "full"}
    other = "full" if mg.recompute != "full" else None
    alt = megatron_plan.plan(recipe, cfg, hardware=hw, rows=rows, moe=moe, recompute=other, timed=False)
    rep.add("activations", f"{gib(first.memory['activations'])} on the first stage with recompute "
                           f"{rec[mg.recompute]}; recompute {rec[other]} would make it "
                           f"{gib(alt.stages[0].memory['activations'])}")
    rep.add("pipeline", f"{tr.grad_accum} micro-batches per step per DP rank, bubble {pl.bubble:.1%} of the step"
                        + (f" ((p-1)/v = {(lay.pp - 1) / lay.vpp:g} idle micro-batch slots)" if lay.pp > 1 else ""))
    rep.add("comm / GPU / step", f"stage {busiest.index}: {pl.net_bytes / 1e9:,.2f} GB over "
            f"the network (PP {busiest.pp_inter / 1e9:,.2f} + DP {busiest.dp_inter / 1e9:,.2f}) + "
            f"{pl.nvlink_bytes / 1e9:,.1f} GB over NVLink (TP"
            f"{' with SP' if lay.sp else ''} {busiest.tp_bytes / 1e9:,.1f} + PP {busiest.pp_intra / 1e9:,.2f} + DP "
            f"{busiest.dp_intra / 1e9:,.2f}); DP group {pl.dp_ring}, PP group {pl.pp_ring}; rank order tp-dp-pp "
            f"(megatron-core's default); grads reduced in fp32")
    slow = max(pl.stages, key=lambda st: st.t_mb)
    rep.add("step time", f"{pl.step_s:.2f} s, MFU {pl.mfu:.1%}: {step_model.dominant_terms(pl.parts, pl.step_s)}; a "
            f"typical micro-batch on stage {slow.index} {slow.t_mb * 1e3:.1f} ms (compute {slow.t_compute * 1e3:.1f} ms, "
            f"GEMMs at {pl.rate:.0f} TFLOP/s, + TP {slow.t_tp * 1e3:.1f} ms + p2p {slow.t_p2p * 1e3:.2f} ms) x ("
            f"{tr.grad_accum} + {(lay.pp - 1) / lay.vpp:g}); {pl.tokens:,.0f} real tokens per step, padding x"
            f"{pl.padding_ratio:.2f}, {pl.tokens / pl.step_s / lay.world:,.0f} tokens/s/GPU")
    rep.add("assumptions", f"{step_model.assumptions(hw, 'bfloat16' if e == 2 else 'float32')}; TP not overlapped, "
            f"p2p on the critical path, DP overlapped with the last micro-batch's backward / the next first forward "
            f"(overlap_grad_reduce {mg.overlap_grad_reduce}, overlap_param_gather {mg.overlap_param_gather}); "
            f"fused attention; {FIXED_BUFFER_GIB:g} GiB fixed buffers (recipes/engines/megatron/pure/costs.py)")
    rep.warnings.extend(pl.notes)
    if lay.pp > 1 and tr.grad_accum < lay.pp:
        rep.warnings.append(f"train.grad_accum: {tr.grad_accum} micro-batches for {lay.pp} pipeline stages: the "
                            f"bubble is {pl.bubble:.0%} of the step")
    if not pl.fits(hw.mem_gib):
        big = max(pl.memory, key=pl.memory.get)
        rep.errors.append(f"memory: stage {peak.index} needs {gib(pl.total)} per GPU, more than the {hw.mem_gib:.2f} "
                          f"GiB a plan may fill (the GPU less 10 %, --gpu-mem-gb): "
                          + ", ".join(f"{k} {gib(v)}" for k, v in pl.memory.items())
                          + f"; the largest part is {big}" + (
                              "; set megatron.recompute (selective, full) or megatron.sequence_parallel" if big ==
                              "activations" else "; more TP / PP" + (" / EP" if moe is not None else "")
                              + ", or megatron.distributed_optimizer"))
    return pl


def _report_experts(rep, cfg, moe, pl: Plan, lay: Placement) -> None:
    """The MoE lines (recipes.planning.moe): total and active parameters, the experts a GPU holds and
    their states over the expert-data-parallel group, the all-to-all bytes and where the EP group sits."""
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


def _routing(moe, share: float, peak, lay: Placement) -> str:
    """The routing the expert numbers assume (recipes.planning.moe: routing imbalance)."""
    acts = f"expert activations {gib(peak.expert_activations)}"
    if moe.imbalance == 1:
        return f"balanced routing assumed (--moe-imbalance 1: each EP rank receives the mean tokens), {acts}"
    if share == 1:
        return f"routing imbalance x{moe.imbalance:g} has no effect at EP 1 (every GPU runs its own tokens' experts)"
    capped = (f", capped at x{share:g}: all the tokens its {moe.experts // lay.ep} experts can take"
              if share < moe.imbalance else "")
    return (f"routing imbalance x{moe.imbalance:g} (--moe-imbalance): the busiest EP rank receives x{share:g} the mean "
            f"tokens{capped}; its {acts} (+{gib(peak.expert_activations * (1 - 1 / share))} over balanced), its "
            f"all-to-all bytes and expert GEMMs x{share:g}")
