"""recipes.evaluation.report's intervals against hand computations: the Wilson interval of one run's exact match
and the paired bootstrap of two runs' difference over the same problems."""

from __future__ import annotations

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
