"""Faults at run time that stop `recipes.train` (tiny random Llama, DeepSpeed on CPU ranks over gloo),
each test showing what is kept and what the user is told.

- a learning rate of 1e30: step 1's update blows the weights up while its loss is still finite; step
  2's loss is NaN. The run stops at step 2 with exit 3 naming the step and the values, metrics.jsonl
  stays strict JSON (null + "nonfinite"), and neither the checkpoint due at step 2 nor the export is
  written (NaN checkpoints would push the good ones out, and `final/` would be all NaN).
- a model whose weights hold a NaN (a bad conversion): exit 3 at step 1, and the advice does not blame
  the learning rate, since no update of this run came before.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("deepspeed")

from tests.recipes.torchrun_helpers import REPO, launch, tiny_workspace  # noqa: E402

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("reliability")
    return root, tiny_workspace(root, problems=64, max_digits=2, hidden=32,
                                train={"steps": 4, "micro_batch_size": 4, "grad_accum": 1, "save_every": 2,
                                       "keep_last": 2, "tensorboard": False})


def _strict_rows(out):
    """metrics.jsonl read by a strict JSON parser (NaN, Infinity are refused)."""
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")
    return [json.loads(line, parse_constant=refuse) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _run(recipe, out, *overrides, nproc=1):
    proc = launch(recipe, out, *overrides, nproc=nproc)
    output, _ = proc.communicate(timeout=600)
    return proc.returncode, output


def test_a_non_finite_run_stops_with_exit_3_and_saves_nothing_after_the_last_good_step(workspace):
    root, recipe = workspace
    out = root / "nan"
    code, output = _run(recipe, out, "optim.lr=1e30")  # finite, so the recipe loads
    assert code != 0 and "exitcode  : 3" in output, output[-3000:]
    assert "step 2: ce, loss, term/smmd, grad_norm" in output and "not finite; stopped without saving" in output, output[-3000:]
    assert "no checkpoint was written" in output
    rows = _strict_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[1]["loss"] is None and "loss" in rows[1]["nonfinite"] and "nonfinite" not in rows[0]
    assert not list((out / "checkpoints").glob("step_*"))  # save_every 2: step 2 was due, and refused
    assert not (out / "final").exists()


def test_non_finite_weights_at_the_first_step_do_not_blame_the_learning_rate(tmp_path, rec_model_dir, rec_data_dir):
    """A model whose weights hold a NaN (a bad conversion) trains one step: exit 3, and the advice says the
    learning rate is not the cause, since no update of this run came before."""
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(rec_model_dir, model)
    weights = load_file(model / "model.safetensors")
    key = next(k for k in weights if k.endswith("mlp.down_proj.weight"))
    weights[key][0, 0] = float("nan")
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "recipes.train", str(REPO / "recipes/configs/demo.yaml"),
                           "model.config=null", f"model.name_or_path={model}", "model.tokenizer=null",
                           f"data.train={rec_data_dir}", "data.eval=null", "train.micro_batch_size=4",
                           "train.global_batch_size=null", "train.steps=2", "train.save_every=0",
                           "deepspeed.zero_stage=0", "train.tensorboard=false", "train.progress=false",
                           f"train.out_dir={tmp_path / 'run'}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "step 1: " in proc.stderr and "the learning rate is not the cause" in proc.stderr, proc.stderr[-3000:]
    assert "Lower optim.lr" not in proc.stderr
