"""Metrics the recipes report on generated answers (docs/losses.md, "What each term computes").

Every metric takes the model's decoded answer texts and the reference numbers. An answer is scored by
the number it reads as (`data_prep.answers.parse_answer`, the reader the gold answers were read with: "####",
\\boxed{}, "the answer is", else the last line's number; docs/evaluation.md), so "x = 42." and "42" are the
same answer. An answer that does not parse counts as wrong for exact match and is left out of MAE and
R² (which are then over the parsed answers only); `parse_rate` says how many that was, so a model that
stops emitting numbers cannot look good on MAE.

    summarize(["42", "x = 7", "oops"], [42, 8, 3])
    # n 3, parse_rate 2/3, exact_match 1/3, mae 0.5 and r2 0.998 (both over the two that parse)

An answer that is not one number (a surd "-14 + 4*sqrt(7)", a base-16 numeral "-191b") has no numeric
target: `summarize` scores it by exact match of the text (`exact_text_match`) and leaves it out of
parse_rate, MAE and R². It reports how many rows each metric used (n_numeric for parse_rate,
n_exact_match, n_mae_r2), so two runs' MAEs over different row counts are not compared blindly.

Clock times ("H:MM", a 12-hour dial) have their own parser and a circular gap in minutes.
"""

from __future__ import annotations

import math
import re
from typing import Sequence

from data_prep.answers import parse_answer

_CLOCK_RE = re.compile(r"(\d{1,2}):(\d{2})")

MINUTES_PER_DIAL = 12 * 60


def _as_parsed(predictions: Sequence) -> list[float | None]:
    """Texts are parsed; numbers (and None) are taken as they are."""
    return [p if p is None or isinstance(p, (int, float)) else parse_answer(p) for p in predictions]


def _check_lengths(predictions: Sequence, targets: Sequence) -> None:
    if len(predictions) != len(targets):
        raise ValueError(f"{len(predictions)} predictions but {len(targets)} targets")


def parse_rate(predictions: Sequence) -> float:
    """Share of predictions that parse as a number (texts are parsed; numbers count as parsed).
    NaN for no predictions."""
    parsed = _as_parsed(predictions)
    if not parsed:
        return math.nan
    return sum(p is not None for p in parsed) / len(parsed)


def _hits(parsed: Sequence[float | None], targets: Sequence[float], tol: float) -> int:
    return sum(p is not None and abs(p - float(t)) <= tol for p, t in zip(parsed, targets))


def exact_match(predictions: Sequence, targets: Sequence[float], tol: float = 1e-9) -> float:
    """Share of predictions whose parsed number equals the target (within `tol`); an unparsed
    prediction is wrong. NaN for no predictions."""
    _check_lengths(predictions, targets)
    parsed = _as_parsed(predictions)
    if not parsed:
        return math.nan
    return _hits(parsed, targets, tol) / len(parsed)


def exact_text_match(prediction, answer_text: str) -> bool:
    """A prediction of an answer that is not one number is right only as the same text, whitespace
    around it aside ("7*sqrt(17)/6" is not "7*sqrt(17) / 6", "-191b" is not "-191B")."""
    return isinstance(prediction, str) and prediction.strip() == answer_text.strip()


def _parsed_pairs(predictions: Sequence, targets: Sequence[float]) -> tuple[list[float], list[float]]:
    _check_lengths(predictions, targets)
    pairs = [(p, float(t)) for p, t in zip(_as_parsed(predictions), targets) if p is not None]
    return [p for p, _ in pairs], [t for _, t in pairs]


def mae(predictions: Sequence, targets: Sequence[float]) -> float:
    """Mean absolute error over the predictions that parse; NaN if none does."""
    preds, tgts = _parsed_pairs(predictions, targets)
    if not preds:
        return math.nan
    return sum(abs(p - t) for p, t in zip(preds, tgts)) / len(preds)


def r2(predictions: Sequence, targets: Sequence[float]) -> float:
    """Coefficient of determination 1 - SS_res / SS_tot over the predictions that parse.

    NaN if none parses or the parsed targets have no variance (R² is undefined there). It can be
    negative: a model worse than predicting the mean.
    """
    preds, tgts = _parsed_pairs(predictions, targets)
    if not preds:
        return math.nan
    mean = sum(tgts) / len(tgts)
    ss_tot = sum((t - mean) ** 2 for t in tgts)
    if ss_tot == 0:
        return math.nan
    ss_res = sum((t - p) ** 2 for p, t in zip(preds, tgts))
    return 1.0 - ss_res / ss_tot


def parse_clock(text: str | None) -> int | None:
    """Minutes past 12:00 on a 12-hour dial for the last "H:MM" in `text` ("11:50" -> 710,
    "12:10" and "0:10" -> 10), or None if there is none or it is not a valid time (minutes > 59,
    hours > 23; hours 13-23 wrap onto the dial)."""
    if text is None:
        return None
    matches = _CLOCK_RE.findall(text)
    if not matches:
        return None
    hours, minutes = (int(x) for x in matches[-1])
    if minutes > 59 or hours > 23:
        return None
    return (hours % 12) * 60 + minutes


def clock_gap_minutes(prediction: str | int | None, target: str | int) -> float | None:
    """The circular gap in minutes between two times on a 12-hour dial (0..360): "11:50" vs "0:10" is 20.

    Either argument may be an "H:MM" text or minutes past 12:00. None if the prediction does not parse.
    """
    p = parse_clock(prediction) if isinstance(prediction, str) or prediction is None else int(prediction)
    t = parse_clock(target) if isinstance(target, str) else int(target)
    if t is None:
        raise ValueError(f"target {target!r} is not an H:MM time")
    if p is None:
        return None
    d = abs(p - t) % MINUTES_PER_DIAL
    return float(min(d, MINUTES_PER_DIAL - d))


def mean_clock_gap(predictions: Sequence, targets: Sequence) -> float:
    """Mean circular gap in minutes over the predictions that parse as "H:MM"; NaN if none does."""
    _check_lengths(predictions, targets)
    gaps = [g for g in (clock_gap_minutes(p, t) for p, t in zip(predictions, targets)) if g is not None]
    return sum(gaps) / len(gaps) if gaps else math.nan


def summarize(predictions: Sequence, targets: Sequence[float | None],
              answer_texts: Sequence[str | None] | None = None) -> dict:
    """All metrics at once, with the number of rows each used (floats; NaN where undefined).

    A target None is an answer that is not one number: the row is scored by `exact_text_match`
    against `answer_texts[i]` and counts in exact_match only; a row with neither counts only in n.

    n, n_numeric (rows with a numeric target), n_text (rows scored by their text); parse_rate over the
    n_numeric rows; exact_match over n_exact_match = n_numeric + n_text rows; mae and r2 over the
    n_mae_r2 numeric rows whose prediction parses.
    """
    _check_lengths(predictions, targets)
    texts = answer_texts if answer_texts is not None else [None] * len(targets)
    _check_lengths(texts, targets)
    num_preds = [p for p, t in zip(predictions, targets) if t is not None]
    num_targets = [float(t) for t in targets if t is not None]
    text_rows = [(p, a) for p, t, a in zip(predictions, targets, texts) if t is None and a is not None]
    parsed = _as_parsed(num_preds)
    n_exact = len(num_preds) + len(text_rows)
    hits = _hits(parsed, num_targets, 1e-9) + sum(exact_text_match(p, a) for p, a in text_rows)
    return {
        "n": len(predictions),
        "n_numeric": len(num_preds),
        "n_text": len(text_rows),
        "parse_rate": parse_rate(num_preds),
        "exact_match": hits / n_exact if n_exact else math.nan,
        "n_exact_match": n_exact,
        "mae": mae(num_preds, num_targets),
        "r2": r2(num_preds, num_targets),
        "n_mae_r2": sum(p is not None for p in parsed),
    }


# ---- closeness of every answer, an unparsed one included --------------------------------------------------
#
# Exact match says whether an answer is right; these say how far off it is, over every answer: an answer
# that does not parse is not left out (as it is from MAE and R² above) but counts as a miss whose absolute
# error is `miss_error`. The studies pass the span of the test set's targets (max - min, `miss_error_for`):
# an unparsed answer is as far off as the worst answer inside the targets' range, one fixed number per test
# set, the same for every model scored on it, so a model cannot gain by not answering.


def miss_error_for(targets: Sequence[float]) -> float:
    """The absolute error an unparsed answer counts as on this test set: the span of its targets
    (max - min), at least 1 (a test set of one value still punishes silence)."""
    values = [float(t) for t in targets]
    if not values:
        raise ValueError("miss_error_for: no targets")
    return max(1.0, max(values) - min(values))


def _digit_at(value: int, place: int) -> int:
    return (value // 10 ** place) % 10


def _places(target: float) -> int | None:
    """How many digit places an integer target has (407: 3; 0: 1); None for a non-integer target."""
    if not float(target).is_integer():
        return None
    return len(str(abs(int(target))))


def closeness_per_problem(predictions: Sequence, targets: Sequence[float], miss_error: float) -> list[dict]:
    """Per problem: `parsed` (the prediction's number or None), `abs_error` (`miss_error` when it does not
    parse), `log_error` log(1 + abs_error), `within_1pct` (|ŷ - y| <= 1% of |y|; at y = 0 only ŷ = 0), and
    `place_hits` for an integer target: one 0/1 per digit place of the target, units first, 1 where the
    prediction is an integer of the target's sign with the same digit at that place (an unparsed,
    non-integer or wrong-signed answer misses every place). A non-integer target has `place_hits` None."""
    _check_lengths(predictions, targets)
    if not (isinstance(miss_error, (int, float)) and math.isfinite(miss_error) and miss_error >= 0):
        raise ValueError(f"miss_error must be a finite number >= 0, got {miss_error!r}")
    out = []
    for p, t in zip(_as_parsed(predictions), targets):
        t = float(t)
        error = float(miss_error) if p is None else abs(float(p) - t)
        places = _places(t)
        hits = None
        if places is not None:
            same_kind = p is not None and float(p).is_integer() and (float(p) < 0) == (t < 0)
            hits = [int(same_kind and _digit_at(abs(int(p)), k) == _digit_at(abs(int(t)), k)) for k in range(places)]
        out.append({"parsed": p, "abs_error": error, "log_error": math.log1p(error),
                    "within_1pct": p is not None and abs(float(p) - t) <= 0.01 * abs(t), "place_hits": hits})
    return out


def closeness(predictions: Sequence, targets: Sequence[float], miss_error: float | None = None) -> dict:
    """Closeness over every answer (`closeness_per_problem`; `miss_error` None: `miss_error_for(targets)`):
    log_mae mean log(1 + |ŷ - y|), mae_all (the mean absolute error, unparsed answers at miss_error),
    median_abs_error, within_1pct, place_accuracy {place: share right} (place 0 the units, over the
    integer targets that have that place), parse_rate, n and the miss_error used."""
    _check_lengths(predictions, targets)
    if not len(targets):
        raise ValueError("closeness: no problems")
    miss = miss_error_for(targets) if miss_error is None else float(miss_error)
    rows = closeness_per_problem(predictions, targets, miss)
    errors = sorted(r["abs_error"] for r in rows)
    mid = len(errors) // 2
    median = errors[mid] if len(errors) % 2 else (errors[mid - 1] + errors[mid]) / 2
    places: dict[int, list[int]] = {}
    for r in rows:
        for k, hit in enumerate(r["place_hits"] or []):
            places.setdefault(k, []).append(hit)
    return {"n": len(rows), "miss_error": miss,
            "parse_rate": sum(r["parsed"] is not None for r in rows) / len(rows),
            "log_mae": sum(r["log_error"] for r in rows) / len(rows),
            "mae_all": sum(r["abs_error"] for r in rows) / len(rows),
            "median_abs_error": median,
            "within_1pct": sum(r["within_1pct"] for r in rows) / len(rows),
            "place_accuracy": {k: sum(v) / len(v) for k, v in sorted(places.items())}}
