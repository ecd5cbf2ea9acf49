"""The loop's side of the per-term gradient diagnostics (`numloss.diagnostics`): which steps compute
them, and the one place where their sums become the logged norms, shares and cosines.

On a diagnosed step each engine returns, beside the loss, this rank's additive gradient sums
(`grad_sums/*`: squared norms and dot products of each part's gradient on the numeric block, summed
over its micro-batches). The loop's existing SUM over the data-parallel group (`parallel.reduce_sum`)
adds them like the losses, and `finish_row` then turns them into the global batch's

    grad/<part>/norm, grad/<part>/share, grad/<part>/cos_ce   (part: ce, each term, z_loss)
    clipped   1 when the step's gradient norm before clipping exceeded optim.grad_clip, else 0
              (None where the engine reports no norm: DeepSpeed at ZeRO stage 0)

Nothing is computed per engine beyond the sums, so both engines log the same values at any layout.
"""

from __future__ import annotations

from numloss.diagnostics import PREFIX, finalize
from recipes.config import Recipe


def logged(recipe: Recipe, step: int) -> bool:
    """Whether the loop writes step `step` (1-based) to metrics.jsonl: every `train.log_every`-th and
    the last."""
    return step % recipe.train.log_every == 0 or step == recipe.train.steps


def diagnosed(recipe: Recipe, step: int) -> bool:
    """Whether step `step` (1-based) computes the gradient diagnostics: a logged step that is a multiple
    of `train.grad_diagnostics_every` (None: of `log_every`, i.e. every logged step) or the last; never
    with 0. Every rank decides the same, so the summed keys match."""
    every = recipe.train.grad_diagnostics_every
    every = recipe.train.log_every if every is None else every
    return every > 0 and logged(recipe, step) and (step % every == 0 or step == recipe.train.steps)


def finish_row(row: dict, grad_clip: float) -> dict:
    """`row` (summed over the data-parallel group, with the engine's `grad_norm`) with its `grad_sums/*`
    replaced by `numloss.diagnostics.finalize`'s values and `clipped` added; unchanged without sums."""
    sums = {key: row[key] for key in row if key.startswith(PREFIX)}
    if not sums:
        return row
    out = {key: value for key, value in row.items() if not key.startswith(PREFIX)}
    out.update(finalize(sums))
    norm = out.get("grad_norm")
    out["clipped"] = None if norm is None else int(grad_clip > 0 and norm > grad_clip)
    return out
