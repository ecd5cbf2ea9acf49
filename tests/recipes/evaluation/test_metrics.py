"""recipes.evaluation.metrics on hand-made answers."""

import math

import numpy as np
import pytest

from recipes.evaluation import metrics


@pytest.mark.parametrize(
    "text, value",
    [("42", 42.0), ("-17", -17.0), ("x = 3.50", 3.5), ("7 then 8", 8.0), (" 0 ", 0.0), ("+5", 5.0),
     (".5", 0.5), ("no number", None), ("", None), (None, None), ("-", None)],
)
def test_answers_read_as_data_prep_reads_them(text, value):
    # metrics reads predictions with data_prep.answers (tests/data_prep/test_answers.py tests the reader)
    assert metrics._as_parsed([text]) == [value]


def test_exact_match_counts_parse_failures_as_wrong():
    preds = ["12", "x=7", "oops", "-3", "4.0"]
    targets = [12, 8, 5, -3, 4]
    assert metrics.exact_match(preds, targets) == pytest.approx(3 / 5)
    assert metrics.parse_rate(preds) == pytest.approx(4 / 5)
    assert metrics.parse_rate([None, 3.0]) == 0.5  # numbers are taken as parsed


def test_mae_and_r2_over_parsed_answers_match_numpy():
    rng = np.random.default_rng(0)
    targets = rng.integers(-200, 200, size=50).astype(float)
    preds = targets + rng.normal(0, 20, size=50).round()
    texts = [str(int(p)) for p in preds]
    texts[3] = texts[10] = "garbage"  # two answers that do not parse are left out of MAE and R²
    keep = np.array([i not in (3, 10) for i in range(50)])
    t, p = targets[keep], preds[keep]
    assert metrics.mae(texts, targets) == pytest.approx(np.abs(p - t).mean())
    r2_numpy = 1 - ((t - p) ** 2).sum() / ((t - t.mean()) ** 2).sum()
    assert metrics.r2(texts, targets) == pytest.approx(r2_numpy)
    summary = metrics.summarize(texts, targets)
    assert summary["n"] == 50 and summary["parse_rate"] == pytest.approx(48 / 50)
    assert summary["mae"] == pytest.approx(np.abs(p - t).mean())


def test_undefined_metrics_are_nan_not_errors():
    assert math.isnan(metrics.mae(["a", "b"], [1, 2]))
    assert math.isnan(metrics.r2(["a", "b"], [1, 2]))
    assert math.isnan(metrics.r2(["1", "2"], [5, 5]))  # no variance in the targets
    assert math.isnan(metrics.exact_match([], []))
    assert metrics.r2(["5", "5"], [4, 6]) == pytest.approx(0.0)  # predicting the mean
    with pytest.raises(ValueError):
        metrics.exact_match(["1"], [1, 2])


@pytest.mark.parametrize(
    "pred, target, gap",
    [("11:50", "0:10", 20), ("0:10", "11:50", 20), ("12:10", "0:10", 0), ("3:00", "9:00", 360),
     ("3:15", "3:05", 10), ("23:50", "0:10", 20), ("the time is 1:30", "1:45", 15), (710, "0:10", 20)],
)
def test_clock_gap_is_circular_on_a_12_hour_dial(pred, target, gap):
    assert metrics.clock_gap_minutes(pred, target) == gap


def test_clock_parse_failures():
    assert metrics.parse_clock("11:50") == 710 and metrics.parse_clock("12:00") == 0
    assert metrics.parse_clock("5:75") is None and metrics.parse_clock("no time") is None
    assert metrics.clock_gap_minutes("later", "1:00") is None
    assert metrics.mean_clock_gap(["11:50", "bad", "1:00"], ["0:10", "1:00", "1:30"]) == pytest.approx(25)
    with pytest.raises(ValueError):
        metrics.clock_gap_minutes("1:00", "noon")


def test_answers_that_are_not_one_number_count_in_exact_match_only():
    # Worked by hand. Numeric rows: 12 right; 8 answered 7 (parsed, error 1); 5 answered "oops".
    # Text rows: a surd answered with the same text (spaces around it), a base-16 numeral answered
    # "-191" (it parses, but a text row is never in MAE). A row with neither counts only in n.
    preds = ["12", "x=7", "oops", " -14 + 4*sqrt(7) ", "-191", "3"]
    targets = [12, 8, 5, None, None, None]
    texts = ["12", "8", "5", "-14 + 4*sqrt(7)", "-191b", None]
    s = metrics.summarize(preds, targets, texts)
    assert (s["n"], s["n_numeric"], s["n_text"], s["n_exact_match"], s["n_mae_r2"]) == (6, 3, 2, 5, 2)
    assert s["parse_rate"] == pytest.approx(2 / 3)
    assert s["exact_match"] == pytest.approx(2 / 5)
    assert s["mae"] == pytest.approx(0.5)  # (0 + 1) / 2
    assert s["r2"] == pytest.approx(1 - 1 / 8)  # targets 12, 8: SS_tot 8, SS_res 1
    assert metrics.exact_text_match("7*sqrt(17)/6\n", "7*sqrt(17)/6")
    assert not metrics.exact_text_match("7*sqrt(17) / 6", "7*sqrt(17)/6")
    assert not metrics.exact_text_match(None, "-191b")
    with pytest.raises(ValueError, match="2 predictions but 3 targets"):
        metrics.summarize(["1", "2"], [1, 2, None])


# ---- closeness over every answer ----------------------------------------------------------------------------


def test_closeness_hand_case_with_an_unparsed_answer():
    preds = ["412", "400", "oops", "1.5", "0", "-3"]
    targets = [412, 407, 90, 2, 0, 3]
    out = metrics.closeness(preds, targets)
    assert out["miss_error"] == 412.0  # the span of the targets, 412 - 0
    errors = [0.0, 7.0, 412.0, 0.5, 0.0, 6.0]
    assert out["mae_all"] == pytest.approx(sum(errors) / 6)
    assert out["log_mae"] == pytest.approx(sum(math.log(1 + e) for e in errors) / 6)
    assert out["median_abs_error"] == pytest.approx((0.5 + 6.0) / 2)  # sorted 0, 0, 0.5, 6, 7, 412
    # within 1%: 412 exact, 400 is 1.7% off 407, 1.5 is 25% off 2, 0 at 0 exact, -3 is 200% off 3
    assert out["within_1pct"] == pytest.approx(2 / 6)
    assert out["parse_rate"] == pytest.approx(5 / 6)
    # places, units first: 412/412 all three; 400 vs 407: hundreds and tens right, units wrong; oops misses
    # both places of 90; 1.5 is no integer (misses 2's one place); 0/0 right; -3 has the wrong sign
    assert out["place_accuracy"] == {0: pytest.approx(2 / 6), 1: pytest.approx(2 / 3), 2: pytest.approx(2 / 2)}


def test_closeness_per_problem_and_a_fixed_penalty():
    rows = metrics.closeness_per_problem(["1000", None, "98"], [1000, 5, 100], miss_error=50.0)
    assert [r["abs_error"] for r in rows] == [0.0, 50.0, 2.0]
    assert [r["place_hits"] for r in rows] == [[1, 1, 1, 1], [0], [0, 0, 0]]
    assert [r["within_1pct"] for r in rows] == [True, False, False]
    assert rows[1]["log_error"] == pytest.approx(math.log(51.0))
    # an answer longer than the target is scored at the target's places only (exact match sees the rest)
    assert metrics.closeness_per_problem(["1407"], [407], 1.0)[0]["place_hits"] == [1, 1, 1]
    assert metrics.closeness_per_problem(["3"], [2.5], 1.0)[0]["place_hits"] is None
    with pytest.raises(ValueError, match="miss_error"):
        metrics.closeness_per_problem(["1"], [1], miss_error=float("nan"))
    with pytest.raises(ValueError, match="predictions but"):
        metrics.closeness(["1"], [1, 2])
    assert metrics.miss_error_for([7, 7]) == 1.0
