"""launch.sweep: a 2x2 grid (two backbones x two losses, one seed) of tiny Ray jobs on the simulated
cluster, evaluated with recipes.evaluation.evaluate, collected into one CSV + Markdown table."""

from __future__ import annotations

import csv
import time

import pytest
import yaml

pytestmark = pytest.mark.timeout(400)


def test_two_by_two_grid_runs_and_writes_the_table(workspace, cluster, tmp_path):
    from launch.sweep import load_sweep, main

    root, recipe = workspace
    spec = {
        "name": "tiny-grid", "base": str(recipe), "out_dir": str(tmp_path / "sweep"),
        "overrides": ["train.steps=2", "train.save_every=0", "train.export=true", f"data.eval={root / 'data'}",
                      "eval.max_new_tokens=4", "eval.batch_size=8"],
        "backbones": {"l1": ["model.config.num_hidden_layers=1"], "l2": ["model.config.num_hidden_layers=2"]},
        "losses": {"ce": ["loss.objective={terms: {}}"], "smmd": ["loss.objective={terms: {smmd: {}}}"]},
        "seeds": [0], "num_workers": 1, "eval_limit": 8,
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    sweep = load_sweep(path)
    assert [j.name for j in sweep.jobs] == ["l1-ce-s0", "l1-smmd-s0", "l2-ce-s0", "l2-smmd-s0"]
    t0 = time.time()
    assert main([str(path)]) == 0
    print(f"sweep: {time.time() - t0:.1f}s")

    rows = list(csv.DictReader((tmp_path / "sweep" / "results.csv").open()))
    assert [r["job"] for r in rows] == [j.name for j in sweep.jobs]
    for r in rows:
        assert r["steps"] == "2" and float(r["train_loss"]) > 0
        assert r["eval_n"] == "8" and r["eval_parse_rate"] != ""
    smmd = next(r for r in rows if r["loss"] == "smmd")
    ce = next(r for r in rows if r["loss"] == "ce")
    assert float(smmd["train_loss"]) != float(smmd["train_ce"]) and float(ce["train_loss"]) == float(ce["train_ce"])
    table = (tmp_path / "sweep" / "results.md").read_text()
    assert "| l2-smmd-s0 | l2 | smmd | 0 | 2 |" in table and "Mean ± std over seeds" in table
    # a second run skips the finished jobs (no training: only the table is rebuilt)
    t1 = time.time()
    assert main([str(path)]) == 0
    assert time.time() - t1 < 20
