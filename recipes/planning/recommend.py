"""The fastest layout for a recipe's model, cluster, global batch and rows, on either engine, by the step
model (recipes.planning.step_model): what `python -m recipes.validate` prints as its recommendation, with
the terms that make each step time.

Candidates, each kept only when its peak stage / GPU fits the usable memory:
- DeepSpeed: ZeRO-2 and ZeRO-3 (hpZ at the node's ranks across nodes), TP 1, every split of a rank's
  rows into micro_batch_size x grad_accum, gradient checkpointing off when that fits, else on. AutoTP is
  left out (tested here with ZeRO-3, not documented by DeepSpeed: docs/cluster.md).
- Megatron (text models without LoRA): TP 1-8 inside a node dividing the heads, KV heads and
  intermediate size (SP on above TP 1), PP up to 16 dividing the layers, DP the rest, every split of a
  replica's rows, recompute none, else selective, else full, whichever fits first; no interleaving.
  A mixture-of-experts model (recipes.planning.moe) also gets every EP dividing its experts and the DP
  size; an EP group that spans nodes (tp x ep above the node's GPUs) only when no layout with it inside a
  node fits (its all-to-alls would cross the network every MoE layer), each at validate's
  --moe-imbalance (the busiest EP rank's share of the tokens). DeepSpeed runs an MoE model as the HF
  module with every expert on every rank (its memory counts them all, its FLOPs the active ones).
The recipe's other settings (dtype, head, reduce dtype, buckets, overlap) stay as they are. Rows: the
recipe's, as the engine pads them (data.length_bucketing included), so a short-row recipe gets the
layout that is fastest at its real lengths, not at the longest.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from recipes.planning import budget as B
from recipes.planning import megatron_layout as ML
from recipes.planning.megatron_report import recipe_plan
from recipes.planning import step_model as sm
from recipes.planning.moe import MoEShape
from recipes.planning.step_model import GiB

MAX_PP = 16
MAX_ROWS_PER_MICRO_BATCH = 16


@dataclass
class Option:
    """One layout the recommendation weighed: what it is, the recipe keys that select it, its plan."""

    engine: str
    text: str
    settings: list[str]
    step_s: float
    mfu: float
    memory: float  # bytes per GPU, peak stage
    parts: dict = field(default_factory=dict)
    rate: float = 0.0
    padding_ratio: float = 1.0

    def line(self) -> str:
        return (f"{self.text}: {self.step_s:.2f} s per step, MFU {self.mfu:.1%}, {self.memory / GiB:.1f} GiB per GPU; "
                f"{sm.dominant_terms(self.parts, self.step_s, 3)}; GEMMs at {self.rate:.0f} TFLOP/s, padding "
                f"x{self.padding_ratio:.2f}")


def _value(v) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def _resets(recipe, section: str) -> list[str]:
    """Overrides that put the other engine's section back to its defaults: a recipe switched to one
    engine is refused while it sets what only the other reads (recipes.checks.engine_settings)."""
    from recipes.config import DeepSpeedSection, MegatronSection

    default = {"deepspeed": DeepSpeedSection(), "megatron": MegatronSection()}[section]
    now = getattr(recipe, section)
    return [f"{section}.{f.name}={_value(getattr(default, f.name))}" for f in fields(default)
            if getattr(now, f.name) != getattr(default, f.name)]


def _divisors(n: int, most: int | None = None) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0 and (most is None or d <= most)]


def deepspeed_options(recipe, shape: B.Shape, params: int, largest: int, hw: sm.Hardware, rows: sm.Rows,
                      global_batch: int) -> list[Option]:
    from recipes.planning.deepspeed_report import recipe_layout

    cl = recipe.cluster
    world = cl.nodes * cl.gpus_per_node
    if global_batch % world:
        return []
    base = recipe_layout(recipe, shape, world)
    out = []
    for zero in (2, 3):
        hpz = cl.gpus_per_node if zero == 3 and cl.nodes > 1 else 1
        for b in _divisors(global_batch // world, MAX_ROWS_PER_MICRO_BATCH):
            for ckpt in (False, True):
                lay = replace(base, zero_stage=zero, tp=1, hpz=hpz, micro_batch_size=b,
                              grad_accum=global_batch // (world * b), checkpointing=ckpt)
                pl = B.deepspeed_plan(shape, params, largest, lay, rows, hw)
                if not B.fits(pl, hw):
                    continue
                text = (f"DeepSpeed ZeRO-{zero}{f' + hpZ {hpz}' if hpz > 1 else ''}, {b} row(s) x {lay.grad_accum} "
                        f"micro-batch(es) per GPU, checkpointing {'on' if ckpt else 'off'}")
                settings = ["train.engine=deepspeed", f"deepspeed.zero_stage={zero}", "deepspeed.tp_size=1",
                            f"train.micro_batch_size={b}", f"train.grad_accum={lay.grad_accum}",
                            f"model.gradient_checkpointing={_value(ckpt)}", *_resets(recipe, "megatron")]
                out.append(Option("deepspeed", text, settings, pl.step_s, pl.mfu, pl.total, pl.parts, pl.rate,
                                  pl.padding_ratio))
                break  # checkpointing only where the layout does not fit without it
    return out


def megatron_options(recipe, cfg, shape: B.Shape, hw: sm.Hardware, rows: sm.Rows, global_batch: int,
                     moe_imbalance: float = 1.0) -> list[Option]:
    moe = MoEShape.of(cfg)
    if moe is not None:  # the busiest EP rank's share of the tokens (recipes.planning.moe)
        moe = replace(moe, imbalance=moe_imbalance)
    inside = _megatron_candidates(recipe, cfg, shape, hw, rows, global_batch, moe, across_nodes=False)
    if inside or moe is None:
        return inside
    return _megatron_candidates(recipe, cfg, shape, hw, rows, global_batch, moe, across_nodes=True)


def _megatron_candidates(recipe, cfg, shape, hw, rows, global_batch, moe, across_nodes: bool) -> list[Option]:
    """megatron_options' layouts; with `moe`, EP groups inside a node, or (`across_nodes`) only those
    that span nodes."""
    cl = recipe.cluster
    world, per_node = cl.nodes * cl.gpus_per_node, cl.gpus_per_node
    out = []
    for tp, pp, ep in ((t, p, x) for t in (1, 2, 4, 8) if per_node % t == 0 for p in _divisors(shape.layers, MAX_PP)
                       for x in (_divisors(moe.experts) if moe is not None else [1])):
        if world % (tp * pp * ep) or (moe is not None and (tp * ep > per_node) != across_nodes):
            continue
        dp = world // (tp * pp)
        lay = ML.Layout(tp, pp, dp, 1, tp > 1, per_node, ep=ep)
        if global_batch % dp or ML.layout_problems(shape, lay, 1, moe):
            continue
        for b in _divisors(global_batch // dp, MAX_ROWS_PER_MICRO_BATCH):
            m = global_batch // (dp * b)
            # the recipe's plan but for what the option sets: its split, the distributed optimizer, the
            # logits head (loss.head=logits below) and recompute
            option = dict(micro_batch_size=b, grad_accum=m, distributed_optimizer=True, chunked_head=False)
            for recompute in (None, "selective", "full"):
                if recipe_plan(recipe, cfg, shape, lay, rows=rows, hw=hw, moe=moe, recompute=recompute, timed=False,
                               **option).peak.total <= hw.mem_gib * GiB:
                    break
            else:
                continue
            pl = recipe_plan(recipe, cfg, shape, lay, rows=rows, hw=hw, moe=moe, recompute=recompute, **option)
            text = (f"Megatron TP {tp}{' + SP' if tp > 1 else ''} x PP {pp} x DP {dp}"
                    f"{f' (EP {ep})' if moe is not None else ''}, {b} row(s) x {m} "
                    f"micro-batches per replica, recompute {recompute or 'none'}")
            settings = ["train.engine=megatron", f"megatron.tp_size={tp}", f"megatron.pp_size={pp}",
                        *([f"megatron.ep_size={ep}"] if moe is not None else []),
                        f"megatron.sequence_parallel={_value(tp > 1)}", "megatron.virtual_pp_size=null",
                        f"megatron.recompute={_value(recompute)}", "megatron.distributed_optimizer=true",
                        f"train.micro_batch_size={b}", f"train.grad_accum={m}", "model.gradient_checkpointing=false",
                        *(["loss.head=logits"] if recipe.loss.head != "logits" else []),
                        *_resets(recipe, "deepspeed")]
            out.append(Option("megatron", text, settings, pl.step_s, pl.mfu, pl.peak.total, pl.parts, pl.rate,
                              pl.padding_ratio))
    return out


def options(recipe, cfg, params: int, largest: int, hw: sm.Hardware, rows: sm.Rows, global_batch: int,
            moe_imbalance: float = 1.0) -> list[Option]:
    """Every candidate that fits (module docstring), fastest first; `moe_imbalance`: the Megatron
    candidates' routing imbalance (recipes.planning.moe)."""
    shape = B.Shape.of(cfg)
    found = deepspeed_options(recipe, shape, params, largest, hw, rows, global_batch)
    if recipe.model.lora is None and not recipe.model.vision:  # what the Megatron engine trains
        found += megatron_options(recipe, cfg, shape, hw, rows, global_batch, moe_imbalance)
    return sorted(found, key=lambda o: o.step_s)


def recommend(rep, recipe, cfg, params: int, largest: int, hw: sm.Hardware, rows: sm.Rows, global_batch: int,
              moe_imbalance: float = 1.0) -> None:
    """validate's recommendation: the fastest fitting layout on either engine and the fastest on each,
    beside the recipe's own predicted step (rep.numbers["step_time_s"]), each with its dominant terms; a
    warning when the recipe's layout is predicted 1.5x slower or more."""
    try:
        found = options(recipe, cfg, params, largest, hw, rows, global_batch, moe_imbalance)
    except AttributeError as err:  # no layer shapes
        rep.warnings.append(f"recommendation: no layer shapes in the model config ({err})")
        return
    if not found:
        rep.add("recommendation", f"no layout of {global_batch} rows per step fits {hw.mem_gib:g} GiB per GPU")
        return
    best = found[0]
    rep.add("recommendation", f"{best.line()}; set {' '.join(best.settings)}")
    for engine in ("deepspeed", "megatron"):
        top = next((o for o in found if o.engine == engine), None)
        if top is not None and top is not best:
            rep.add(f"fastest on {engine}", top.line())
    rep.numbers["recommendation"] = {"engine": best.engine, "layout": best.text, "settings": best.settings,
                                     "step_time_s": best.step_s, "mfu": best.mfu, "parts": best.parts}
    rep.numbers["recommendation_options"] = [{"engine": o.engine, "layout": o.text, "step_time_s": o.step_s}
                                             for o in found]
    own = rep.numbers.get("step_time_s")
    if own and own > 1.5 * best.step_s:
        rep.warnings.append(f"layout: the recipe's layout is predicted at {own:.2f} s per step, {own / best.step_s:.1f}x "
                            f"the recommended one ({best.text}, {best.step_s:.2f} s) at these rows ({rows.note})")
