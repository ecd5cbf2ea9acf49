"""recipes.training.run_log: metrics.jsonl rows are strict JSON (a non-finite value is null, its key named
under "nonfinite"), appended whole, and a restart trims the rows past its checkpoint instead of
duplicating them."""

from __future__ import annotations

import json
import math

from recipes.training.run_log import append_row, nonfinite_keys, strict_json_row, truncate_rows


def test_rows_are_strict_json_with_the_non_finite_keys_named():
    row = {"step": 2, "loss": math.nan, "grad_norm": math.inf, "lr": 1e-3, "tokens_per_s": 10.0}
    assert nonfinite_keys(row) == ["loss", "grad_norm"]
    text = json.dumps(strict_json_row(row), allow_nan=False)
    assert json.loads(text) == {"step": 2, "loss": None, "grad_norm": None, "lr": 1e-3, "tokens_per_s": 10.0,
                                "nonfinite": ["loss", "grad_norm"]}
    assert strict_json_row({"step": 1, "grad_norm": None}) == {"step": 1, "grad_norm": None}  # ZeRO-0: no norm


def test_metrics_rows_are_appended_whole_and_a_restart_drops_the_rows_past_its_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    for step in (1, 2, 3, 4, 3):  # a duplicate of step 3 from an earlier, unlocked run
        append_row(path, {"step": step, "loss": float("nan") if step == 4 else 1.0 / step})
    with path.open("a") as f:
        f.write('{"step": 5, "lo')  # torn by a crash mid-write
    truncate_rows(path, 3)  # resuming from the checkpoint of step 3
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    truncate_rows(path, 0)  # no checkpoint: nothing logged before counts
    assert path.read_text() == ""
