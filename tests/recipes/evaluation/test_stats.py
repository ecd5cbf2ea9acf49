"""recipes.evaluation.stats, the intervals the report prints, against hand computations: the Wilson interval of
one run's exact match and the paired bootstrap of two runs' difference over the same problems."""

from __future__ import annotations

import math
import statistics

import pytest

from recipes.evaluation import report as R
from recipes.evaluation import stats as S


def test_wilson_interval_by_hand():
    # 5/10, z = 1.96: centre (0.5 + 1.96²/20) / (1 + 1.96²/10) = 0.5;
    # half = 1.96 sqrt(0.25/10 + 1.96²/400) / (1 + 1.96²/10) = 1.96 * 0.186022 / 1.384146 = 0.263414
    low, high = S.wilson_interval(5, 10)
    assert (low, high) == pytest.approx((0.236586, 0.763414), abs=1e-5)
    # 0/20: the interval is [0, z²/n / (1 + z²/n)] = [0, 0.192073 / 1.192073], not the empty [0, 0]
    assert S.wilson_interval(0, 20) == pytest.approx((0.0, 0.161125), abs=1e-5)
    assert S.wilson_interval(20, 20)[1] == 1.0
    with pytest.raises(ValueError, match="successes out of"):
        S.wilson_interval(11, 10)


def test_paired_bootstrap_by_hand():
    # differences [1, 0]: a resample of two problems has mean 0, 1/2 or 1 with probability 1/4, 1/2,
    # 1/4, so the 2.5% and 97.5% quantiles are 0 and 1 and P(mean <= 0) is 1/4
    out = S.paired_bootstrap([1, 0], [0, 0], resamples=20000)
    assert (out["diff"], out["low"], out["high"], out["n"]) == (0.5, 0.0, 1.0, 2)
    assert out["p_le_0"] == pytest.approx(0.25, abs=0.01)
    # the same answers on every problem: the difference is exactly 0, with no spread at all
    same = S.paired_bootstrap([1, 0, 1, 1], [1, 0, 1, 1])
    assert (same["diff"], same["low"], same["high"]) == (0.0, 0.0, 0.0)


def test_two_level_bootstrap_counts_exact_ties_as_not_above_zero():
    # 3 seeds agreeing, 10 problems, the system right on 5 and the baseline on the other 5: a resample's
    # difference is (X - (10 - X)) / 10 with X ~ Binomial(10, 1/2) the draws that land on the system's
    # problems, so P(difference <= 0) = P(X <= 5) = 638/1024 = 0.623, a quarter of it exact ties (X = 5).
    # Summed with fractional weights, a rounding error decided a tie's sign (0.541 measured here).
    out = S.two_level_bootstrap([[1, 0] * 5] * 3, [[0, 1] * 5] * 3, resamples=20000)
    assert out["p_le_0"] == pytest.approx(638 / 1024, abs=0.012)
    assert out["diff"] == 0.0 and out["low"] == -0.6 and out["high"] == 0.6  # X in [2, 8] at 95%: exact


def test_pairing_cancels_what_both_runs_share():
    # 200 problems; b solves the first 100, a solves those and 4 more: a difference of 0.02, which two
    # separate Wilson intervals (each ~±0.07) cannot tell from 0, but the paired interval can
    # (the discordant problems are 4 of 200: 0.02 ± ~2 sqrt(4)/200).
    b = [1] * 100 + [0] * 100
    a = [1] * 104 + [0] * 96
    out = S.paired_bootstrap(a, b, resamples=4000)
    assert out["diff"] == pytest.approx(0.02)
    assert 0.0 < out["low"] < 0.02 < out["high"] <= 0.045
    assert out["p_le_0"] < 0.05
    low_a, _ = S.wilson_interval(104, 200)
    _, high_b = S.wilson_interval(100, 200)
    assert low_a < high_b  # unpaired intervals overlap
    with pytest.raises(ValueError, match="same problems"):
        S.paired_bootstrap([1, 0], [1])


def test_table_interval_column():
    results = [{"name": "ce", "metrics": {"n": 10, "n_numeric": 10, "exact_match": 0.5, "mae": 1.0}}]
    table = R.markdown_table(results, interval=True)
    assert "exact match [95% CI]" in table and "| 0.5 [0.237, 0.763] |" in table
    assert "[" not in R.markdown_table(results)


# ---- two-level bootstrap over training seeds and test problems ------------------------------------------


def test_t_quantiles_against_tables():
    # df = 2 has a closed form: t = (2p - 1) / sqrt(2 p (1 - p)); df = 1 is Cauchy: tan(pi (p - 1/2))
    assert S.t_quantile(0.975, 2) == pytest.approx(0.95 / (2 * 0.975 * 0.025) ** 0.5, rel=1e-7)
    assert S.t_quantile(0.975, 1) == pytest.approx(12.706205, rel=1e-6)
    assert S.t_quantile(0.975, 10) == pytest.approx(2.228139, rel=1e-6)
    assert S.t_quantile(0.025, 4) == pytest.approx(-2.776445, rel=1e-6)


def test_seed_level_t_interval_by_hand():
    # 3 seeds, 10 problems; at seed s the system solves s + 1 problems more than the baseline: per-seed
    # differences 0.1, 0.2, 0.3; mean 0.2, sd 0.1, half-width t(0.975, 2) * 0.1 / sqrt(3)
    # = 4.302653 * 0.057735 = 0.248414
    base = [[0] * 10 for _ in range(3)]
    system = [[1] * (s + 1) + [0] * (9 - s) for s in range(3)]
    v = S.two_level_bootstrap(system, base, resamples=2000)
    assert v["per_seed"] == pytest.approx([0.1, 0.2, 0.3]) and v["diff"] == pytest.approx(0.2)
    t = v["seed_t"]
    assert (t["mean"], t["sd"], t["n"]) == (pytest.approx(0.2), pytest.approx(0.1), 3)
    assert (t["low"], t["high"]) == pytest.approx((-0.048414, 0.448414), abs=1e-6)
    assert v["reason"] is None and t["reason"] is None and v["n_problems"] == 10
    assert S.versus_cells(v) == ("+20.0 [" + f"{100 * v['low']:+.1f}, {100 * v['high']:+.1f}]",
                                 "+10.0, +20.0, +30.0", "[-4.8, +44.8]")


def test_seeds_that_differ_widen_the_interval_problems_that_do_not_cannot_narrow_it():
    # Every problem has the same difference within a seed (0, 0.1, 0.2 at seeds 0-2): the one-level
    # bootstrap of the per-problem means sees no spread at all, [0.1, 0.1]. Over seeds, a resample is the
    # mean of three draws from {0, 0.1, 0.2}; all three 0 (or all 0.2) has probability 1/27 = 3.7% > 2.5%,
    # so the 95% interval is [0, 0.2].
    system = [[c] * 50 for c in (0.0, 0.1, 0.2)]
    base = [[0.0] * 50 for _ in range(3)]
    one = S.paired_bootstrap([sum(col) / 3 for col in zip(*system)], [0.0] * 50)
    assert (one["low"], one["high"]) == pytest.approx((0.1, 0.1))
    two = S.two_level_bootstrap(system, base, resamples=20000)
    assert (two["low"], two["high"]) == pytest.approx((0.0, 0.2))
    # 0/1 outcomes: 200 problems, the baseline solves the first 60 at every seed and the system 60 + 10 s
    # at seed s (differences 0, 0.05, 0.10): pooled per problem, the shares give ~0.05 ± 0.02; over
    # seeds the interval must reach from about 0 to about 0.1
    base = [[1] * 60 + [0] * 140 for _ in range(3)]
    system = [[1] * (60 + 10 * s) + [0] * (140 - 10 * s) for s in range(3)]
    one = S.paired_bootstrap([sum(col) / 3 for col in zip(*system)], [sum(col) / 3 for col in zip(*base)])
    two = S.two_level_bootstrap(system, base)
    assert two["diff"] == pytest.approx(one["diff"]) == pytest.approx(0.05)
    assert two["low"] < one["low"] - 0.02 and two["high"] > one["high"] + 0.02
    assert two["low"] <= 0.005 and two["high"] >= 0.095


def test_seeds_that_agree_give_the_one_level_interval():
    # The same outcomes at every seed: the seed draw changes nothing, and the problems (drawn once per
    # resample for every seed: one test set) give the one-level interval, up to Monte-Carlo error.
    base = [1] * 80 + [0] * 120
    system = [1] * 74 + [0] * 6 + [1] * 20 + [0] * 100  # 20 won, 6 lost: +0.07
    one = S.paired_bootstrap(system, base, resamples=20000)
    two = S.two_level_bootstrap([system] * 3, [base] * 3, resamples=20000, seed=1)
    assert two["diff"] == pytest.approx(one["diff"]) == pytest.approx(0.07)
    assert two["low"] == pytest.approx(one["low"], abs=0.006) and two["high"] == pytest.approx(one["high"], abs=0.006)
    assert two["seed_t"]["sd"] == 0.0 and two["seed_t"]["low"] == two["seed_t"]["high"] == pytest.approx(0.07)


def test_fewer_than_three_seeds_give_no_interval():
    v = S.two_level_bootstrap([[1, 1, 0], [1, 0, 0]], [[1, 0, 0], [1, 0, 0]])
    assert v["diff"] == pytest.approx(1 / 6) and v["per_seed"] == pytest.approx([1 / 3, 0.0])
    assert v["low"] is v["high"] is v["p_le_0"] is None and "no ranking" in v["reason"]
    assert v["seed_t"]["low"] is None and "no ranking" in v["seed_t"]["reason"]
    assert S.versus_cells(v) == ("+16.7, 2 seeds: no ranking", "+33.3, +0.0", "–")
    with pytest.raises(ValueError, match="same seeds and problems"):
        S.two_level_bootstrap([[1, 0]] * 3, [[1, 0, 1]] * 3)


def test_seeds_to_exclude_zero_by_hand():
    """Mean 1.0, SD 1.8: at 15 seeds t(14) = 2.1448 gives a half-width 2.1448 * 1.8 / sqrt(15) = 0.997 < 1;
    at 14, t(13) = 2.1604 gives 1.039 > 1. The interval `seed_t_interval` draws agrees at both counts."""
    assert S.seeds_to_exclude_zero(1.0, 1.8) == 15
    assert S.seeds_to_exclude_zero(-1.0, 1.8) == 15  # the sign does not matter
    for n, excludes in ((15, True), (14, False)):
        # n values with mean 1.0 and sample SD 1.8: +-a around the mean (n even) or with the mean added (n odd)
        a = 1.8 * ((n - 1) / (n - (n % 2))) ** 0.5
        sample = [1.0 + a] * (n // 2) + [1.0 - a] * (n // 2) + [1.0] * (n % 2)
        t = S.seed_t_interval(sample)
        assert t["sd"] == pytest.approx(1.8) and (t["low"] > 0) == excludes
    assert S.seeds_to_exclude_zero(2.0, 0.0) == S.MIN_SEEDS  # no spread: the seeds already run suffice
    assert S.seeds_to_exclude_zero(0.0, 1.0) is None  # no difference: no number of seeds
    assert S.seeds_to_exclude_zero(0.01, 3.0, limit=1000) is None  # ~350,000 needed: past the limit
    with pytest.raises(ValueError, match="mean nan"):
        S.seeds_to_exclude_zero(float("nan"), 1.0)


def test_paired_t_p_matches_the_t_table_and_holm_a_hand_case():
    from recipes.evaluation.stats import holm, paired_t_p

    # five differences with mean 1 and sd 1: t = sqrt(5) = 2.236 at 4 df, two-sided p = 0.0890 (tables)
    d = [0.0, 0.0, 1.0, 2.0, 2.0]
    assert statistics.mean(d) == pytest.approx(1.0) and statistics.stdev(d) == pytest.approx(1.0)
    assert paired_t_p(d) == pytest.approx(0.0890, abs=5e-4)
    # t = 2.776 is the 97.5% quantile at 4 df: p = 0.05
    mean = 2.776445 / math.sqrt(5)
    assert paired_t_p([x - 1 + mean for x in d]) == pytest.approx(0.05, abs=2e-5)
    assert paired_t_p([0.2]) is None and paired_t_p([0.0, 0.0]) == 1.0 and paired_t_p([0.1, 0.1]) == 0.0
    # Holm: sorted 0.01, 0.03, 0.04 times 3, 2, 1 -> 0.03, 0.06, 0.04 -> monotone 0.03, 0.06, 0.06
    adjusted = holm({"a": 0.04, "b": 0.01, "c": 0.03})
    assert adjusted == {"b": pytest.approx(0.03), "c": pytest.approx(0.06), "a": pytest.approx(0.06)}
    assert holm({"x": 0.7, "y": 0.6}) == {"y": pytest.approx(1.0), "x": pytest.approx(1.0)}
