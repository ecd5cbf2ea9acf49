"""The Megatron engine's plan of a recipe (`plan`, the contract's): its placement (tensor x pipeline x data
parallel, expert parallel for MoE models; rank order tp-dp-pp, megatron-core's default), the errors of its layout on
the recipe's cluster (`cluster_problems`; those the model's shape decides are the contract's
`shape_problems`), and what the
model's config decides (tied embeddings, q / k / v biases, Qwen3's q / k norms, the experts), priced by
recipes.engines.megatron.pure.costs into a `recipes.planning.Plan`. Also the layouts the recommender weighs
on this engine (`layout_candidates`). Pure: no torch, no megatron.
"""

from __future__ import annotations

from dataclasses import replace

from recipes.engines.megatron.pure.layout import parallel_dims, shape_problems
from recipes.engines.megatron.pure.support import qk_norm
from recipes.engines.megatron.pure import costs
from recipes.planning import moe as moe_math
from recipes.planning.moe import MoEShape
from recipes.planning.placement import Placement
from recipes.planning.plan import Candidate, Plan, divisors, override
from recipes.planning.shape import Shape

ENGINE = costs.ENGINE
MAX_PP = 16
MAX_ROWS_PER_MICRO_BATCH = 16


# ---- the layout ------------------------------------------------------------------------------------------


def placement(recipe) -> Placement:
    """The recipe's layout on its cluster's ranks (an invalid virtual_pp_size counts as no interleaving:
    `cluster_problems` names it)."""
    mg, cl = recipe.megatron, recipe.cluster
    per_node = cl.ranks_per_node()
    if mg.virtual_pp_size is not None and (mg.pp_size < 2 or mg.virtual_pp_size < 2):
        mg = replace(mg, virtual_pp_size=None)
    return Placement(parallel_dims(mg, cl.nodes * per_node), max(1, per_node))


def cluster_problems(recipe) -> list[str]:
    """The errors of the recipe's layout before the model's shape is known, each naming its keys."""
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
    if mg.virtual_pp_size is not None and (mg.pp_size < 2 or (mg.virtual_pp_size or 1) < 2):
        errors.append(f"megatron.virtual_pp_size: {mg.virtual_pp_size} needs megatron.pp_size >= 2 and a value >= 2 "
                      "(null: no interleaving)")
    dp = max(1, world // (mg.tp_size * mg.pp_size))
    ep = mg.ep_size
    if ep > 1 and per_node > 0 and world % (mg.tp_size * mg.pp_size) == 0 and dp % ep:
        errors.append(f"megatron.ep_size: {ep} does not divide the data-parallel size {dp} = world / (tp x pp) "
                      f"(megatron-core lays the experts out as tp x ep x pp x world / (tp ep pp))")
    return errors


# ---- the plan --------------------------------------------------------------------------------------------


def model_flags(config) -> tuple[bool, bool, bool]:
    """(tied, qkv_bias, qk_norm) of the cost model, from the model's config: tied embeddings, biases on
    q / k / v (recipes.planning.moe.qkv_bias: qwen2, qwen2_moe), Qwen3's per-head q / k norms (as the
    engine's conversion reads them)."""
    c = getattr(config, "text_config", None) or config
    return bool(getattr(c, "tie_word_embeddings", False)), moe_math.qkv_bias(c), qk_norm(c)


def experts(model_cfg, moe_imbalance: float = 1.0) -> MoEShape | None:
    """The model's experts at a routing imbalance (recipes.planning.moe); ValueError for an MoE family
    the planner does not size."""
    moe = MoEShape.of(model_cfg)
    return replace(moe, imbalance=moe_imbalance) if moe is not None else None


def plan(recipe, model_cfg, *, hardware, rows, world_size: int | None = None, moe_imbalance: float = 1.0,
         gpus: bool = True, params: tuple[int, int] | None = None, where: Placement | None = None,
         **changes) -> Plan:
    """The plan of the recipe's layout (or `where`) at `rows` on `hardware` (recipes.planning.step_model),
    with everything the recipe and the model's config decide: the one prediction `recipes.validate`
    reports and a run's log sets beside what it measured. `world_size`: the ranks the run has (the
    cluster's when None; a layout needs them to divide). `gpus`: whether the run has GPUs (Transformer
    Engine's spec packs a micro-batch's rows back to back, THD, there only). `params` (the model's count)
    is not needed: the cost model counts each stage's parameters from the shape. `changes`: cost-model
    arguments that differ from the recipe's (recompute, micro_batch_size, grad_accum,
    distributed_optimizer, chunked_head, `timed` False: memory only). AttributeError when the config has
    no layer shapes, ValueError for an MoE family the planner does not size."""
    where = where or placement(recipe)
    if world_size is not None and world_size != where.world:
        where = Placement(replace(where.dims, world=world_size, dp=0), where.gpus_per_node)
    shape = Shape.of(model_cfg)
    moe = changes.pop("moe") if "moe" in changes else experts(model_cfg, moe_imbalance)
    mg, e = recipe.megatron, 2 if recipe.model.dtype == "bfloat16" else 4
    tied, qkv_bias, has_qk_norm = model_flags(model_cfg)
    pl = costs.estimate(shape, where, **{
        "micro_batch_size": recipe.train.micro_batch_size, "rows": rows, "grad_accum": recipe.train.grad_accum,
        "tied": tied, "recompute": mg.recompute, "distributed_optimizer": mg.distributed_optimizer,
        "overlap_grad_reduce": mg.overlap_grad_reduce, "overlap_param_gather": mg.overlap_param_gather,
        "chunked_head": recipe.loss.head == "chunked", "chunk_size": recipe.loss.chunk_size,
        "qkv_bias": qkv_bias, "qk_norm": has_qk_norm, "hw": hardware, "e": e,
        "thd": mg.transformer_impl != "local" and gpus, "moe": moe, **changes})
    # what the engine's checkpoint holds (recipes/engines/megatron/runtime/checkpoints.py), each tensor once: the
    # weights in the model's dtype, Adam's two fp32 moments and, for a 16-bit model, its fp32 main weights
    pl.checkpoint_bytes = moe_math.parameter_counts(model_cfg).total * (e + 8 + (4 if e < 4 else 0))
    if changes.get("chunked_head", recipe.loss.head == "chunked"):
        pl.notes.append("loss.head: chunked: the Megatron engine computes the objective on GPTModel's "
                        "vocab-parallel logits (loss.head: logits); estimated with the chunked head as asked")
    if recipe.model.gradient_checkpointing:
        pl.notes.append("model.gradient_checkpointing: not used by the Megatron engine; megatron.recompute is")
    return pl


# ---- what the recommender weighs -------------------------------------------------------------------------


def layout_candidates(recipe, model_cfg, *, hardware, rows, global_batch: int, params: tuple[int, int],
                      moe_imbalance: float = 1.0) -> list[Candidate]:
    """The layouts of `global_batch` rows per step on the recipe's cluster that fit `hardware.mem_gib`, for
    a text model without LoRA (what this engine trains): TP 1-8 inside a node dividing the heads, KV heads
    and widths (SP on above TP 1), PP up to 16 dividing the layers, DP the rest, every split of a
    replica's rows, recompute none, else selective, else full, whichever fits first; no interleaving.
    A mixture-of-experts model also gets every EP dividing its experts and the DP size; an EP group that
    spans nodes (tp x ep above the node's GPUs) only when no layout with it inside a node fits (its
    all-to-alls would cross the network every MoE layer), each at `moe_imbalance` (the busiest EP rank's
    share of the tokens). The recipe's other settings (dtype, tied embeddings, biases, overlaps) stay."""
    if recipe.model.lora is not None or recipe.model.vision:
        return []
    moe = experts(model_cfg, moe_imbalance)
    inside = _candidates(recipe, model_cfg, hardware, rows, global_batch, moe, across_nodes=False)
    if inside or moe is None:
        return inside
    return _candidates(recipe, model_cfg, hardware, rows, global_batch, moe, across_nodes=True)


def _candidates(recipe, model_cfg, hw, rows, global_batch, moe, across_nodes: bool) -> list[Candidate]:
    """layout_candidates' layouts; with `moe`, EP groups inside a node, or (`across_nodes`) only those
    that span nodes."""
    cl = recipe.cluster
    shape = Shape.of(model_cfg)
    world, per_node = cl.nodes * cl.gpus_per_node, cl.gpus_per_node
    out = []
    for tp, pp, ep in ((t, p, x) for t in (1, 2, 4, 8) if per_node % t == 0 for p in divisors(shape.layers, MAX_PP)
                       for x in (divisors(moe.experts) if moe is not None else [1])):
        if world % (tp * pp * ep) or (moe is not None and (tp * ep > per_node) != across_nodes):
            continue
        dp = world // (tp * pp)
        lay = Placement.of(tp, pp, dp, 1, tp > 1, per_node, ep=ep)
        if global_batch % dp or shape_problems(shape, lay.dims, 1, moe):
            continue
        for b in divisors(global_batch // dp, MAX_ROWS_PER_MICRO_BATCH):
            m = global_batch // (dp * b)
            # the recipe's plan but for what the candidate sets: its split, the distributed optimizer, the
            # logits head (loss.head=logits below) and recompute
            option = dict(micro_batch_size=b, grad_accum=m, distributed_optimizer=True, chunked_head=False)
            for recompute in (None, "selective", "full"):
                if plan(recipe, model_cfg, hardware=hw, rows=rows, where=lay, moe=moe, recompute=recompute,
                        timed=False, **option).fits(hw.mem_gib):
                    break
            else:
                continue
            pl = plan(recipe, model_cfg, hardware=hw, rows=rows, where=lay, moe=moe, recompute=recompute, **option)
            text = (f"Megatron TP {tp}{' + SP' if tp > 1 else ''} x PP {pp} x DP {dp}"
                    f"{f' (EP {ep})' if moe is not None else ''}, {b} row(s) x {m} "
                    f"micro-batches per replica, recompute {recompute or 'none'}")
            settings = [override("train.engine", ENGINE), override("megatron.tp_size", tp),
                        override("megatron.pp_size", pp), *([override("megatron.ep_size", ep)] if moe is not None else []),
                        override("megatron.sequence_parallel", tp > 1), override("megatron.virtual_pp_size", None),
                        override("megatron.recompute", recompute), override("megatron.distributed_optimizer", True),
                        override("train.micro_batch_size", b), override("train.grad_accum", m),
                        override("model.gradient_checkpointing", False),
                        *([override("loss.head", "logits")] if recipe.loss.head != "logits" else [])]
            out.append(Candidate(ENGINE, text, settings, pl))
    return out
