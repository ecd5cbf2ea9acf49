"""Each term's size against CE at the start of a run: a term whose weighted value is many times CE's
drives the update by its scale alone, whatever its weight was meant to say.

    lines = scale_lines(config, ce=11.8, terms={"ntl_was": 136.7})
    # ['term ntl_was = 136.7 x weight 0.3 = 41.01 is 3.5x CE (11.8) ...']   (said above SCALE_LIMIT)

A numeric term's value depends on the numeric vocabulary (NTL-WAS over the integers 0-999 measures
distances in the hundreds at initialisation, over the digits at most 9) and on the model, so a default
weight chosen for one setup can be tens of times CE in another. The check is advice: it names the term and
the weight at which its value would equal CE's on the same batch, and refuses nothing.
"""

from __future__ import annotations

import math

from .objective import DEFAULT_WEIGHTS, ObjectiveConfig

SCALE_LIMIT = 5.0  # a weighted term above this many times CE is named


def term_weight(config: ObjectiveConfig, name: str) -> float:
    """The weight a term of `config` trains with (its default where none is given)."""
    weight = config.terms[name].weight
    return float(DEFAULT_WEIGHTS.get(name, 1.0) if weight is None else weight)


def checked_terms(config: ObjectiveConfig) -> list[str]:
    """The terms of `config` whose scale can be named: those entering with a weight other than 0 and not
    as `rescale_to_ce` (their value pinned to CE's)."""
    return [name for name, term in config.terms.items() if not term.rescale_to_ce and term_weight(config, name) != 0]


def scale_table(config: ObjectiveConfig, ce: float, terms: dict[str, float]) -> list[dict]:
    """Per term of `config` found in `terms` (its unweighted value on one batch): name, value, weight,
    weighted value, its ratio to `ce` and the weight at which it would equal `ce`, for the `checked_terms`."""
    rows = []
    checked = checked_terms(config)
    for name, value in terms.items():
        if name not in checked or value is None or not math.isfinite(value):
            continue
        weight = term_weight(config, name)
        weighted = weight * value
        ratio = weighted / ce if ce > 0 else math.inf
        rows.append({"term": name, "value": value, "weight": weight, "weighted": weighted, "ratio": ratio,
                     "matching_weight": ce / value if value > 0 else None})
    return rows


def scale_lines(config: ObjectiveConfig, ce: float, terms: dict[str, float], limit: float = SCALE_LIMIT,
                where: str = "the first batch") -> list[str]:
    """One line per term whose weighted value is more than `limit` times CE on the batch the values come
    from, naming the weight that would match CE; [] when every term is within it."""
    lines = []
    for row in scale_table(config, ce, terms):
        if row["ratio"] <= limit:
            continue
        match = f"{row['matching_weight']:.3g}" if row["matching_weight"] is not None else "n/a"
        lines.append(f"term {row['term']} = {row['value']:.4g} x weight {row['weight']:g} = {row['weighted']:.4g} is"
                     f" {row['ratio']:.1f}x CE ({ce:.4g}) on {where}: its scale, not its weight, will drive the"
                     f" update; weight {match} would make it equal CE (set loss.objective.terms.{row['term']}.weight,"
                     " or rescale_to_ce: true)")
    return lines
