"""Intervals for answer metrics: one run's exact match (Wilson), the difference of two runs over the
same problems (paired bootstrap), and the difference of two losses over training seeds and problems
(two-level bootstrap, with the seed-level t interval next to it): the last is the one that ranks losses,
since a loss's runs differ from seed to seed about as much as two losses differ."""

from __future__ import annotations

import math
import statistics
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


# ---- differences against a baseline across training seeds ----------------------------------------------

MIN_SEEDS = 3  # below this a seed-level spread is one or no degree of freedom: no interval is shown
NO_RANKING = "fewer than {min} seeds: no ranking can be read, no interval shown"


def _t_cdf(x: float, df: int) -> float:
    """Student's t distribution function, by Simpson's rule on its density from 0 (no SciPy in the
    project's dependencies). 2,000 panels: the quantiles below match tables to 6 digits for df >= 2
    and to 1e-6 relative at df = 1, whose heavy tail is the hardest case."""
    if x < 0:
        return 1.0 - _t_cdf(-x, df)
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    panels = 2000
    xs = np.linspace(0.0, x, panels + 1)
    pdf = np.exp(log_norm - (df + 1) / 2 * np.log1p(xs * xs / df))
    weights = np.ones(panels + 1)
    weights[1:-1:2], weights[2:-1:2] = 4.0, 2.0
    return 0.5 + float((weights * pdf).sum()) * x / (3 * panels)


def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t with `df` degrees of freedom (bisection on `_t_cdf`)."""
    if not 0 < p < 1 or df < 1:
        raise ValueError(f"t_quantile: p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    low, high = 0.0, 1.0
    while _t_cdf(high, df) < p:  # df = 1 at p = 0.999 needs ~318: grow the bracket instead of guessing it
        high *= 2
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if _t_cdf(mid, df) < p else (low, mid)
    return (low + high) / 2


def t_half_width(sd: float, n: int, level: float = 0.95) -> float:
    """Half the width of the t interval of a mean of `n` observations with sample SD `sd`."""
    return t_quantile(1 - (1 - level) / 2, n - 1) * sd / math.sqrt(n)


def seed_t_interval(per_seed: Sequence[float], level: float = 0.95) -> dict:
    """Mean of per-seed differences with its t interval, each seed one observation (n - 1 degrees of
    freedom). This is the interval a run-to-run spread alone allows; it ignores which test problems
    were drawn, which the seed means already average over. Below MIN_SEEDS seeds: "low" and "high"
    are None and "reason" says why. Returns {"mean", "sd", "low", "high", "n", "reason"}."""
    d = [float(x) for x in per_seed]
    if not d:
        raise ValueError("seed_t_interval: no seeds")
    mean = sum(d) / len(d)
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1)) if len(d) > 1 else None
    out = {"mean": mean, "sd": sd, "low": None, "high": None, "n": len(d), "reason": None}
    if len(d) < MIN_SEEDS:
        out["reason"] = NO_RANKING.format(min=MIN_SEEDS)
        return out
    half = t_half_width(sd, len(d), level)
    out.update(low=mean - half, high=mean + half)
    return out


def seeds_to_exclude_zero(mean: float, sd: float, level: float = 0.95, limit: int = 10000) -> int | None:
    """The fewest seeds whose t interval (`seed_t_interval`) would exclude 0 if the per-seed differences
    kept this mean and standard deviation: a planning figure for "is this difference worth more seeds",
    not a power analysis (the observed mean of 3 seeds is itself that uncertain). None when the mean is
    0 or more than `limit` seeds would be needed; MIN_SEEDS when the observed seeds already suffice."""
    if sd < 0 or not math.isfinite(mean) or not math.isfinite(sd):
        raise ValueError(f"seeds_to_exclude_zero: mean {mean}, sd {sd}")
    if mean == 0:
        return None
    if sd == 0:
        return MIN_SEEDS
    z = statistics.NormalDist().inv_cdf(1 - (1 - level) / 2)  # t is wider than the normal: at least z's n
    n = max(MIN_SEEDS, math.ceil((z * sd / abs(mean)) ** 2))
    while n <= limit:
        if t_half_width(sd, n, level) < abs(mean):
            return n
        n += 1
    return None


def seed_differences(per_seed: Sequence[float], level: float = 0.95, n_problems: int | None = None) -> dict:
    """Per-seed differences against a baseline without a bootstrap: what can be said when only each
    seed's score is known (no per-problem outcomes). The shape of `two_level_bootstrap`'s result, with
    "low", "high" and "p_le_0" None; "reason" says why there is no interval."""
    t = seed_t_interval(per_seed, level)
    return {"diff": t["mean"], "low": None, "high": None, "p_le_0": None, "n_seeds": t["n"],
            "n_problems": n_problems, "per_seed": [float(x) for x in per_seed], "seed_t": t,
            "reason": t["reason"] or "no per-problem outcomes: the seed-level t interval only"}


def two_level_bootstrap(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]], resamples: int = 10000,
                        seed: int = 0, level: float = 0.95) -> dict:
    """mean(a) - mean(b) over training seeds and test problems, with an interval that counts both.

    `a[s][i]` and `b[s][i]` are a system's and its baseline's scores (1/0 correct) at training seed s on
    problem i: paired by seed (same data order and initial weights) and by problem. Each resample
    draws the seeds with replacement, then the problems with replacement, and takes the mean paired
    difference over the drawn (seed, problem) cells. The problems are drawn once per resample and
    used for every drawn seed: every seed was scored on the same test set (problems are crossed with
    seeds, not nested in them), so drawing them anew for each seed would count one test set as
    several and shrink its share of the spread by sqrt(seeds). Hence: when the seeds agree the
    interval is the one-level `paired_bootstrap` of the per-problem means; when they disagree it
    widens by their spread.

    Returns {"diff", "low", "high", "p_le_0", "n_seeds", "n_problems", "per_seed", "seed_t", "reason"}:
    "per_seed" the difference at each seed, "seed_t" `seed_t_interval` of those. Below MIN_SEEDS seeds
    "low", "high" and "p_le_0" are None and "reason" says why: a bootstrap over one or two seeds
    cannot see the run-to-run spread, and an interval from it would rank what it cannot.
    """
    da, db = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if da.ndim != 2 or da.shape != db.shape:
        raise ValueError(f"two_level_bootstrap: scores of shape {da.shape} against {db.shape}; "
                         "pair them as [seed][problem] over the same seeds and problems")
    if not da.size:
        raise ValueError("two_level_bootstrap: no seeds or no problems")
    diff = da - db
    n_seeds, n_problems = diff.shape
    out = seed_differences(diff.mean(axis=1), level, n_problems)
    out["diff"] = float(diff.mean())  # the same mean, without the rounding of a mean of means
    if n_seeds < MIN_SEEDS:
        return out
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    for start in range(0, resamples, 1000):  # 1000 resamples at a time bounds the weight matrices
        k = min(1000, resamples - start)
        # Resampling with replacement as multinomial counts: the mean over the drawn cells is then
        # seed_counts . diff . problem_counts / (seeds x problems), one matrix product for the whole chunk.
        # The counts stay integers until the one division: with 1/0 scores every sum is an exact integer,
        # so a resample whose difference is exactly 0 (frequent with few discordant problems) counts as
        # <= 0 on every machine, instead of by the sign of a rounding error in fractional weights.
        problems = rng.multinomial(n_problems, np.full(n_problems, 1 / n_problems), size=k)
        seeds = rng.multinomial(n_seeds, np.full(n_seeds, 1 / n_seeds), size=k)
        means[start:start + k] = ((problems @ diff.T) * seeds).sum(axis=1) / (n_problems * n_seeds)
    tail = (1 - level) / 2
    out.update(low=float(np.quantile(means, tail)), high=float(np.quantile(means, 1 - tail)),
               p_le_0=float((means <= 0).mean()), reason=None)
    return out


def versus_cells(v: dict, scale: float = 100.0) -> tuple[str, str, str]:
    """A `two_level_bootstrap` (or `seed_differences`) result as three table cells: the difference with
    its two-level interval, the per-seed differences, and the seed-level t interval, values times
    `scale` (100: points). Below MIN_SEEDS seeds the first cell says no ranking can be read and no
    cell holds an interval; without per-problem outcomes the first cell says "seed level only"."""
    def num(x: float) -> str:
        return f"{scale * x:+.1f}"

    per_seed = ", ".join(num(x) for x in v["per_seed"])
    if v["n_seeds"] < MIN_SEEDS:
        return f"{num(v['diff'])}, {v['n_seeds']} seed{'s' * (v['n_seeds'] != 1)}: no ranking", per_seed, "–"
    t = v["seed_t"]
    both = f" [{num(v['low'])}, {num(v['high'])}]" if v["low"] is not None else " (seed level only)"
    return num(v["diff"]) + both, per_seed, f"[{num(t['low'])}, {num(t['high'])}]"


# ---- tests over seeds, adjusted for a family of comparisons ----------------------------------------------


def paired_t_p(per_seed: Sequence[float]) -> float | None:
    """The two-sided p-value of a paired t test that the mean per-seed difference is 0 (n - 1 degrees of
    freedom). None below 2 seeds; with no spread: 1.0 for a mean of 0, else 0.0."""
    d = [float(x) for x in per_seed]
    if len(d) < 2:
        return None
    mean = sum(d) / len(d)
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1))
    if sd == 0:
        return 1.0 if mean == 0 else 0.0
    t = abs(mean) / (sd / math.sqrt(len(d)))
    return min(1.0, 2.0 * (1.0 - _t_cdf(t, len(d) - 1)))


def holm(pvalues: dict) -> dict:
    """Holm's step-down adjustment of a family of p-values ({name: p} -> {name: adjusted p}): the k-th
    smallest is multiplied by (m - k + 1), kept monotone, capped at 1. Rejecting where the adjusted p is
    below alpha holds the family-wise error at alpha for any dependence between the tests."""
    order = sorted(pvalues, key=lambda name: pvalues[name])
    m, running, out = len(order), 0.0, {}
    for k, name in enumerate(order):
        running = max(running, min(1.0, (m - k) * float(pvalues[name])))
        out[name] = running
    return out
