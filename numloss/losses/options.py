"""What each term's options may be, checked when an `ObjectiveConfig` is made, not at the first forward.

A rule per option: finite numbers with the sign the term's math needs, choices from the term's own
list, and the shapes it indexes (SMMD's `sigmas` a non-empty list of positive numbers, never a scalar).
Options not listed here (a `generator`, `position_weights` tensors) are checked where they are used.
"""

from __future__ import annotations

import math
from typing import Any, Callable


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def finite(minimum: float | None = None, *, strict: bool = False, maximum: float | None = None,
           optional: bool = False) -> Callable[[Any], str | None]:
    """A finite number >= minimum (> minimum when strict, <= maximum); None allowed when optional."""
    def check(value):
        if value is None and optional:
            return None
        if not _number(value):  # never a string, even "3": a quoted number is a mistake in the config
            return f"expected a number, got {value!r}"
        if not math.isfinite(value):
            return f"must be a finite number, got {value!r}"
        if minimum is not None and (value <= minimum if strict else value < minimum):
            return f"must be {'>' if strict else '>='} {minimum}, got {value!r}"
        if maximum is not None and value > maximum:
            return f"must be <= {maximum}, got {value!r}"
        return None
    return check


def choice(*allowed) -> Callable[[Any], str | None]:
    return lambda value: None if value in allowed else f"must be one of {list(allowed)}, got {value!r}"


def boolean(value: Any) -> str | None:
    return None if isinstance(value, bool) else f"expected true/false, got {value!r}"


def positive_list(value: Any) -> str | None:
    if not isinstance(value, (list, tuple)) or not value:
        return f"expected a non-empty list of positive numbers (e.g. [2.0]), got {value!r}"
    bad = [v for v in value if not _number(v) or not math.isfinite(v) or v <= 0]
    return f"every entry must be a finite number > 0, got {value!r}" if bad else None


RULES: dict[str, dict[str, Callable[[Any], str | None]]] = {
    "smmd": {"sigmas": positive_list, "squash_factor": finite(0, strict=True, optional=True),
             "kernel": choice("gaussian", "laplace"), "alpha": finite(0, optional=True),
             "mode": choice("smmd", "mmd", "smooth")},
    "ntl_was": {"squash_factor": finite(1, optional=True), "reweigh": boolean},
    "ntl_mse": {"loss": choice("mse", "mae", "huber"), "reweigh": boolean},
    "gce": {"sigma": finite(0), "renormalize": boolean},
    "dist2": {"tau": finite(0, strict=True), "normalize": choice("full", "numeric"),
              "weighting": choice("none", "place_value")},
    "ntil": {"digit_exp": finite(0, strict=True), "digit_alpha": finite(0), "abs_alpha": finite(0),
             "mag_alpha": finite(0), "tau": finite(0, strict=True), "noise_scale": finite(0)},
}

# the term's weight: a finite number >= 0 (a negative weight trains the model away from the targets);
# GCE's mixes CE and GCE as (1 - w) CE + w GCE, so it stays in [0, 1]
WEIGHT_RULES = {"gce": finite(0, maximum=1)}
DEFAULT_WEIGHT_RULE = finite(0)


def option_problems(name: str, options: dict, weight: float | None) -> list[str]:
    """Every problem of one term's weight and options, each as `terms.<name>.<key>: problem`, the key's
    path in the objective's mapping (empty: fine)."""
    problems = []
    if weight is not None:
        problem = WEIGHT_RULES.get(name, DEFAULT_WEIGHT_RULE)(weight)
        if problem:
            problems.append(f"terms.{name}.weight: {problem}")
    for key, value in options.items():
        rule = RULES.get(name, {}).get(key)
        problem = rule(value) if rule is not None else None
        if problem:
            problems.append(f"terms.{name}.{key}: {problem}")
    return problems
