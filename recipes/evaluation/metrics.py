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
