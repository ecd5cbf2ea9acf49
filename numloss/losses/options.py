"""Rules for a term's options, checked when an `ObjectiveConfig` is made, not at the first forward.

A rule is `rule(value) -> None` (fine) or a message saying what is wrong. Each term registers a rule per
option (`numloss.register_term(..., options={...})`): finite numbers (in float32, the dtype the terms
compute in: `float32_problem`) with the sign the term's math needs,
choices from the term's own list, and the shapes it indexes (SMMD's `sigmas` a non-empty list of positive
numbers, never a scalar). Options without a rule (a `generator`, `position_weights` tensors) are checked
where they are used.
"""

from __future__ import annotations

import math
import struct
from typing import Any, Callable


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def float32_problem(value: float, strict_positive: bool = False) -> str | None:
    """Why a finite number is not usable in float32, the dtype the losses and the optimizer's state compute
    in whatever the model's dtype (bf16 training keeps float32 master weights): it overflows to inf
    (|value| > 3.4028e+38), or, where it must be > 0, it rounds to 0. None: it is usable."""
    try:
        rounded = struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # older Pythons raise where newer ones round to inf
        rounded = math.inf
    if not math.isfinite(rounded):
        return f"must be a finite float32 number (|value| <= 3.4028e+38: it is computed in float32), got {value!r}"
    if strict_positive and value > 0 and rounded == 0:
        return f"must be > 0 in float32 (it is computed in float32, where {value!r} is 0)"
    return None


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
        in_float32 = float32_problem(value, strict_positive=strict and minimum == 0)
        if in_float32:
            return in_float32
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
    bad = [v for v in value if not _number(v) or not math.isfinite(v) or v <= 0
           or float32_problem(v, strict_positive=True)]
    return f"every entry must be a finite float32 number > 0, got {value!r}" if bad else None


def token_id(value: Any) -> str | None:
    """A vocabulary id (an int >= 0) or None."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return None
    return f"expected a token id (an integer >= 0) or null, got {value!r}"


# A term's weight: a finite number >= 0 (a negative weight trains the model away from the targets); a
# term that replaces CE mixes the two as (1 - w) CE + w term, so its weight stays in [0, 1]
# (`numloss.losses.registry`).
DEFAULT_WEIGHT_RULE = finite(0)
