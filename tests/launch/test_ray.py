"""launch.ray on a simulated 2-node Ray cluster (real Ray, gloo, DeepSpeed ZeRO-3 on CPU)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from .conftest import STEPS

pytestmark = pytest.mark.timeout(400)


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def reference(workspace, cluster):
    from launch.ray import run

    root, recipe = workspace
    out = root / "reference"
    t0 = time.time()
    summary = run(recipe, [f"train.out_dir={out}"], name=f"reference-{time.time_ns()}")
    print(f"reference run: {time.time() - t0:.1f}s")
    return out, summary


def test_two_nodes_one_worker_each(reference):
    out, summary = reference
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    ranks = json.loads((out / "ranks.json").read_text())
    assert sorted(ranks) == ["0", "1"]
    assert ranks["0"]["node_id"] != ranks["1"]["node_id"], ranks  # PACK over two 1-CPU nodes: one each
    assert summary["metrics"]["step"] == STEPS and summary["metrics"]["loss"] == rows[-1]["loss"]
    assert summary["checkpoint"]["step"] == STEPS
    assert (out / "checkpoints" / "latest").read_text() == f"step_{STEPS:08d}"
