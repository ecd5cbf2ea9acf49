"""recipes.study: the aggregation over seeds against a hand computation, and the whole grid at tiny size."""

from __future__ import annotations

import json
import statistics

import pytest

from recipes import study

pytest.importorskip("deepspeed")


def _record(tokenizer, loss, seed, em, mae, parse=1.0):
    return {"tokenizer": tokenizer, "loss": loss, "seed": seed, "final": {"ce": 1.0 + seed},
            "metrics": {"exact_match": em, "mae": mae, "r2": None if mae is None else 0.5, "parse_rate": parse}}


def test_aggregate_means_and_spreads_over_seeds():
    records = [_record("digits", "ce", 0, 0.1, 10.0), _record("digits", "ce", 1, 0.3, 20.0),
               _record("digits", "ce", 2, 0.2, None, parse=0.0),  # nothing parsed: no MAE for this seed
               _record("digits", "smmd", 0, 0.5, 4.0)]
    rows = study.aggregate(records)
    ce, smmd = rows
    assert (ce["loss"], ce["seeds"], smmd["loss"], smmd["seeds"]) == ("ce", 3, "smmd", 1)
    assert ce["exact_match"] == pytest.approx(0.2) and ce["exact_match_sd"] == pytest.approx(0.1)
    assert ce["mae"] == pytest.approx(15.0) and ce["mae_n"] == 2
    assert ce["mae_sd"] == pytest.approx(statistics.stdev([10.0, 20.0]))
    assert ce["final_ce"] == pytest.approx(2.0)
    table = study.markdown(rows)
    assert "| digits | ce | 3 | 20.0 ± 10.0 | 15.00 ± 7.07 (2 seeds) |" in table
    assert "| digits | smmd | 1 | 50.0 (1 seed) | 4.00 (1 seed) |" in table


def test_study_grid_end_to_end_at_tiny_size(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    assert study.main(["--out", str(out), "--work", str(work), "--seeds", "1", "--steps", "2",
                       "--losses", "ce,smmd", "--tokenizers", "digits", "--train-examples", "200",
                       "--eval-examples", "16"]) == 0
    names = sorted(p.stem for p in (out / "runs").glob("*.json"))
    assert names == ["digits-ce-s0", "digits-smmd-s0"]
    record = json.loads((out / "runs" / "digits-smmd-s0.json").read_text())
    assert [r["step"] for r in record["curve"]] == [1, 2] and record["metrics"]["n"] == 16
    assert "term/smmd" in record["final"]
    assert (out / "results.md").read_text().count("| digits |") == 2
    for plot in ("curves-digits.png", "probe-digits.png"):
        assert (out / plot).stat().st_size > 1000
    # a second start finds every run done and only rebuilds the report
    before = (out / "runs" / "digits-ce-s0.json").stat().st_mtime_ns
    assert study.main(["--out", str(out), "--work", str(work), "--seeds", "1", "--losses", "ce,smmd",
                       "--tokenizers", "digits", "--train-examples", "200", "--eval-examples", "16"]) == 0
    assert (out / "runs" / "digits-ce-s0.json").stat().st_mtime_ns == before
