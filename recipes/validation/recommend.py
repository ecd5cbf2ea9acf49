"""The one recommender: the fastest layout for a recipe's model, cluster, global batch and rows on any
engine (`recommend`: what `python -m recipes.validate` prints as its recommendation, with the terms that
make each step time). Every engine in `recipes.engines.ENGINES` is asked, through its contract, for the
layouts it could run (`layout_candidates`: each kept only when its peak stage / GPU fits the usable
memory); every candidate is a plan of that engine's cost model (recipes.planning.step_model's
arithmetic), so they compare. (The changes of a recipe's own layout that shorten its step are its
engine's report lines: validate's advice.)

A candidate on one engine also puts the other engines' recipe sections back to their defaults (a recipe
switched to one engine is refused while it sets what only another reads: the contract's adopt_settings).
Rows: the recipe's, as each engine pads them (data.length_bucketing included), so a short-row recipe
gets the layout that is fastest at its real lengths, not at the longest.
"""

from __future__ import annotations

from dataclasses import fields

from recipes.engines import ENGINES
from recipes.planning import step_model
from recipes.planning.plan import Candidate, override
from recipes.planning.step_model import GiB


def line(c: Candidate) -> str:
    pl = c.plan
    return (f"{c.text}: {pl.step_s:.2f} s per step, MFU {pl.mfu:.1%}, {pl.total / GiB:.1f} GiB per GPU; "
            f"{step_model.dominant_terms(pl.parts, pl.step_s, 3)}; GEMMs at {pl.rate:.0f} TFLOP/s, padding "
            f"x{pl.padding_ratio:.2f}")


def _resets(recipe, contract) -> list[str]:
    """Overrides that put `contract`'s recipe section back to its defaults (none: it has no section)."""
    if contract.Section is None:
        return []
    default, now = contract.Section(), getattr(recipe, contract.section)
    return [override(f"{contract.section}.{f.name}", getattr(default, f.name)) for f in fields(default)
            if getattr(now, f.name) != getattr(default, f.name)]


def options(recipe, cfg, params: int, largest: int, hw: step_model.Hardware, rows: step_model.Rows,
            global_batch: int, moe_imbalance: float = 1.0) -> list[Candidate]:
    """Every engine's candidates that fit (module docstring), fastest first; `moe_imbalance`: the routing
    imbalance of the candidates with expert parallelism (recipes.planning.moe)."""
    found = []
    for contract in ENGINES.values():
        resets = [r for other in ENGINES.values() if other is not contract for r in _resets(recipe, other)]
        for candidate in contract.layout_candidates(recipe, cfg, hardware=hw, rows=rows, global_batch=global_batch,
                                                    params=(params, largest), moe_imbalance=moe_imbalance):
            candidate.settings += resets
            found.append(candidate)
    return sorted(found, key=lambda c: c.plan.step_s)


def recommend(rep, recipe, cfg, params: int, largest: int, hw: step_model.Hardware, rows: step_model.Rows,
              global_batch: int, moe_imbalance: float = 1.0) -> None:
    """validate's recommendation: the fastest fitting layout on any engine and the fastest on each, beside
    the recipe's own predicted step (rep.numbers["step_time_s"]), each with its dominant terms; a warning
    when the recipe's layout is predicted 1.5x slower or more."""
    try:
        found = options(recipe, cfg, params, largest, hw, rows, global_batch, moe_imbalance)
    except AttributeError as err:  # no layer shapes
        rep.warnings.append(f"recommendation: no layer shapes in the model config ({err})")
        return
    if not found:
        rep.add("recommendation", f"no layout of {global_batch} rows per step fits {hw.mem_gib:g} GiB per GPU")
        return
    best = found[0]
    rep.add("recommendation", f"{line(best)}; set {' '.join(best.settings)}")
    for engine in ENGINES:
        top = next((c for c in found if c.engine == engine), None)
        if top is not None and top is not best:
            rep.add(f"fastest on {engine}", line(top))
    rep.numbers["recommendation"] = {"engine": best.engine, "layout": best.text, "settings": best.settings,
                                     "step_time_s": best.plan.step_s, "mfu": best.plan.mfu, "parts": best.plan.parts}
    rep.numbers["recommendation_options"] = [{"engine": c.engine, "layout": c.text, "step_time_s": c.plan.step_s}
                                             for c in found]
    own = rep.numbers.get("step_time_s")
    if own and own > 1.5 * best.plan.step_s:
        rep.warnings.append(f"layout: the recipe's layout is predicted at {own:.2f} s per step, "
                            f"{own / best.plan.step_s:.1f}x the recommended one ({best.text}, {best.plan.step_s:.2f} s) "
                            f"at these rows ({rows.note})")

