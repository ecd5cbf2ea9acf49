"""recipes.evaluation.data_parallel: the HF backend over 2 torchrun ranks (gloo, CPU) gives one process's results."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from recipes.evaluation import evaluate as E
from recipes.evaluation.data_parallel import Ranks, share

REPO = Path(__file__).resolve().parents[3]


def test_rows_are_dealt_round_robin_in_length_order():
    rows = [{"prompt_ids": [0] * n} for n in (5, 1, 3, 3, 9, 2, 7)]
    parts = [share(rows, Ranks(r, 3, r)) for r in range(3)]
    assert sorted(i for p in parts for i in p) == list(range(7))
    assert parts == [[1, 3, 4], [5, 0], [2, 6]]  # by length: 1(1) 5(2) 2(3) 3(3) 0(5) 6(7) 4(9), dealt 0 1 2 0 1 2 0


@pytest.mark.timeout(300)
def test_two_ranks_give_the_results_of_one_process(rec_model_dir, rec_data_dir, tmp_path):
    out = tmp_path / "dp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "recipes.evaluate", "--model", rec_model_dir, "--data", rec_data_dir, "--backend", "hf",
           "--limit", "14", "--batch-size", "3", "--max-new-tokens", "6", "--out", str(out), "--name", "dp"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    ranked = json.loads(out.read_text())
    one = E.evaluate(rec_model_dir, rec_data_dir, backend="hf", limit=14, batch_size=3, max_new_tokens=6, name="dp")
    assert ranked["settings"]["data_parallel_ranks"] == 2 and one["settings"]["data_parallel_ranks"] == 1
    assert [e["prediction"] for e in ranked["examples"]] == [e["prediction"] for e in one["examples"]]
    assert any(e["prediction"] for e in one["examples"])
    assert ranked["examples"] == one["examples"] and ranked["metrics"] == one["metrics"]
    assert done.stdout.count("wrote ") == 1  # rank 0 alone writes and prints
