"""The contract's proof: a third engine, this folder, trains through the shipped `recipes.validate` and
`recipes.train` after one registration line (`RUN`), with no shipped file naming it.

- validate: exit 0 with the engine's own layout line; exit 2 with its refusal on 2 ranks.
- train, one process: 3 steps of CE + SMMD on a tiny random Llama; the step-3 checkpoint (the engine's
  save_state) holds after 3 AdamW steps exactly the weights the export wrote (the one export writer); a
  resume loads it (load_state) and trains step 4, its optimizer continuing at step 4.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recipes.reliability.export_writer import read_export
from tests.recipes.torchrun_helpers import read_metrics, tiny_workspace

REPO = Path(__file__).resolve().parents[4]
# the one line a process needs to know the engine (its contract; recipes.engines.ENGINES stays the registry)
RUN = ("import runpy, sys; from recipes.engines import register; from tests.recipes.engines.plain_torch.pure.contract "
       "import PlainTorchContract; register(PlainTorchContract); "
       "sys.argv = sys.argv[1:]; runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")
ONE_RANK = ["train.engine=plain_torch", "cluster.cpu_ranks_per_node=1"]


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.run([sys.executable, "-c", RUN, module, *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    root = tmp_path_factory.mktemp("plain_torch")
    return root, tiny_workspace(root, problems=32, max_digits=2, hidden=32,
                                train={"steps": 3, "micro_batch_size": 4, "grad_accum": 2, "save_every": 3})


def test_validate_reports_and_refuses_through_the_engines_contract(recipe):
    _, path = recipe
    ok = _run("recipes.validate", path, *ONE_RANK, "--offline")
    assert ok.returncode == 0, ok.stdout + ok.stderr[-3000:]
    assert "1 rank(s), one process: plain torch" in ok.stdout
    two = _run("recipes.validate", path, "train.engine=plain_torch", "cluster.cpu_ranks_per_node=2", "--offline")
    assert two.returncode == 2, two.stdout + two.stderr[-3000:]
    assert "train.engine: plain_torch runs one process; the cluster gives 2 ranks" in two.stdout


def test_three_steps_checkpoint_export_and_resume(recipe):
    root, path = recipe
    out = root / "run"
    done = _run("recipes.train", path, *ONE_RANK, f"train.out_dir={out}")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor([r["loss"], r["term/smmd"], r["grad_norm"]])).all() for r in rows)
    tag = (out / "checkpoints" / "latest").read_text().strip()
    state = torch.load(out / "checkpoints" / tag / "plain_torch.pt", weights_only=True)
    assert state["step"] == 3 and {float(s["step"]) for s in state["optimizer"]["state"].values()} == {3.0}
    exported = read_export(out / "final")
    assert set(exported) == set(state["model"])
    assert all(torch.equal(exported[k], state["model"][k]) for k in exported)

    resumed = _run("recipes.train", path, *ONE_RANK, f"train.out_dir={out}", "train.steps=4", "train.save_every=4")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]
    tag = (out / "checkpoints" / "latest").read_text().strip()
    state = torch.load(out / "checkpoints" / tag / "plain_torch.pt", weights_only=True)
    assert state["step"] == 4 and {float(s["step"]) for s in state["optimizer"]["state"].values()} == {4.0}
