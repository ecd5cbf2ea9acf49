"""Intervals for answer metrics: one run's exact match (Wilson) and the difference of two runs over the
same problems (paired bootstrap)."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval of a proportion (95% for the default z). Unlike the normal
    approximation it stays inside [0, 1] and is not empty at 0 or n successes, which is where a
    zero-shot model's exact match sits."""
    if n <= 0:
        raise ValueError(f"wilson_interval: n must be positive, got {n}")
    if not 0 <= successes <= n:
        raise ValueError(f"wilson_interval: {successes} successes out of {n}")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_bootstrap(a: Sequence[float], b: Sequence[float], resamples: int = 10000, seed: int = 0,
                     level: float = 0.95) -> dict:
    """mean(a) - mean(b) over the same problems, with a percentile bootstrap interval.

    `a[i]` and `b[i]` are two systems' scores on problem i (1/0 correct, or a mean over seeds): the
    per-problem differences are resampled with replacement, so what the two share (a problem both get
    right or both miss) cancels, which makes the interval much tighter than two separate ones.
    Returns {"diff", "low", "high", "n", "p_le_0"} (p_le_0: share of resamples with a difference
    <= 0, a one-sided bootstrap p-value for "a beats b")."""
    if len(a) != len(b):
        raise ValueError(f"paired_bootstrap: {len(a)} scores against {len(b)}; pair them over the same problems")
    if not len(a):
        raise ValueError("paired_bootstrap: no problems")
    diff = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    for start in range(0, resamples, 1000):  # 1000 resamples at a time bounds the index matrix
        k = min(1000, resamples - start)
        means[start:start + k] = diff[rng.integers(0, len(diff), size=(k, len(diff)))].mean(axis=1)
    tail = (1 - level) / 2
    return {"diff": float(diff.mean()), "low": float(np.quantile(means, tail)),
            "high": float(np.quantile(means, 1 - tail)), "n": len(diff), "p_le_0": float((means <= 0).mean())}
