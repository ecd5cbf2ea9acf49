"""`make demo` (recipes/experiments/demo.py) at a tiny size: disjoint data, the 2-rank DeepSpeed runs, the table
and the plots. The tiny random-weight path (`--tiny`) is what runs here; the SmolLM2 path is the same
code with the backbone directory in place of the tiny model and tokenizer (tests stay offline and small;
tests/recipes/experiments/test_backbone.py covers the conversion)."""

from __future__ import annotations

import json
import re

import pytest

from recipes.experiments import demo

pytest.importorskip("deepspeed")


def test_problems_are_disjoint_and_correct(tmp_path):
    train_path, eval_path = demo.write_problems(tmp_path, n_train=500, n_eval=100)
    train = [json.loads(line) for line in train_path.read_text().splitlines()]
    held_out = [json.loads(line) for line in eval_path.read_text().splitlines()]
    assert len(train) == 500 and len(held_out) == 100
    assert not {p["prompt"] for p in train} & {p["prompt"] for p in held_out}
    for problem in train + held_out:  # "Evaluate a + b." / "What is a - b?" / ...
        a, op, b = re.search(r"(\d+) ([+-]) (\d+)", problem["prompt"]).groups()
        assert int(problem["target"]) == (int(a) + int(b) if op == "+" else int(a) - int(b)), problem
    (tmp_path / "again").mkdir()
    _, again = demo.write_problems(tmp_path / "again", n_train=500, n_eval=100)
    assert again.read_text() == eval_path.read_text()  # a fixed seed: the same split


def test_demo_end_to_end_at_tiny_size(tmp_path):
    out = tmp_path / "demo"
    assert demo.main(["--tiny", "--out", str(out), "--steps", "3", "--train-examples", "200",
                      "--eval-examples", "24"]) == 0
    table = (out / "results.md").read_text().splitlines()
    assert len([line for line in table if line.startswith("| CE")]) == 2, table  # a row per objective
    assert "exact match [95% CI]" in table[0]
    assert table[-1].startswith("One seed (0) of 3 steps per loss") and "cannot rank CE and CE+SMMD" in table[-1]
    for name in ("CE", "CE_SMMD"):
        results = json.loads((out / name / "eval.json").read_text())
        assert len(results["examples"]) == 24
        assert {"exact_match", "mae", "parse_rate"} <= set(results["metrics"])
        rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2, 3]
        assert ("term/smmd" in rows[0]) == (name == "CE_SMMD")
    for plot in ("curves.png", "probe.png"):
        assert (out / plot).stat().st_size > 1000
    # --resume with the same arguments reuses the finished runs and their evaluations
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("CE*/*") if p.name in ("eval.json", "metrics.jsonl")}
    assert len(stamps) == 4
    assert demo.main(["--tiny", "--resume", "--out", str(out), "--steps", "3", "--train-examples", "200",
                      "--eval-examples", "24"]) == 0
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    assert (out / "results.md").read_text().splitlines() == table
