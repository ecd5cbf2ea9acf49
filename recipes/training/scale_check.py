"""Each term's scale against CE before a run's first update (`numloss.scale_check`): a term whose weighted
value is many times CE's would drive the update by its scale alone, so it is named, with the weight that
would make it equal CE, before step 1 trains on it.

The values are those of the first step's own micro-batches at the starting weights: the engine's forward
without an update (`Engine.eval_step`, no answers), normalised over the step's global counts and summed over
the data-parallel group, as step 1 would log them (in eval mode: no dropout). The training is unchanged: no
gradient, the training mode restored by the engine, the RNG state of every device restored here
(`torch.random.fork_rng`). It runs once, on a run's first start (a resume does not repeat it), and only when
a term could be named (`numloss.scale_check.checked_terms`): a CE-only recipe pays no forward.
"""

from __future__ import annotations

import torch

from numloss.scale_check import checked_terms, scale_lines
from recipes.config import Recipe

from .parallel import reduce_sum

WHERE = "the first step's global batch at the starting weights"


def first_step_scale(recipe: Recipe, engine, window: list[dict], device: torch.device) -> list[str] | None:
    """The lines to say before step 1 (`scale_advice` on `window`, this rank's micro-batches of step 1), the
    same on every rank; None where the engine has no forward without an update for this model (then the
    loop asks `scale_advice` of step 1's logged row). A collective: every rank calls it."""
    if not checked_terms(recipe.loss.objective):
        return []
    if not callable(getattr(engine, "eval_step", None)) or engine.eval_problem() is not None:
        return None
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        sums, _ = engine.eval_step(window, answers=False)
    return scale_advice(recipe, reduce_sum(sums, device, engine.dp.group), WHERE)


def scale_advice(recipe: Recipe, values: dict, where: str) -> list[str]:
    """Each term of `values` (a global batch's logged values: ce, term/<name>) against its CE, for a term
    many times CE at its weight (`numloss.scale_check.scale_lines`); `where` names the batch and weights."""
    config = recipe.loss.objective
    terms = {name: values[f"term/{name}"] for name in config.terms if isinstance(values.get(f"term/{name}"), float)}
    if not isinstance(values.get("ce"), float) or not terms:
        return []
    return scale_lines(config, values["ce"], terms, where=where)
