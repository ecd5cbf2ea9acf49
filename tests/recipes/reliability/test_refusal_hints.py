"""The advice a stopped or refused run gives must be able to help (issue 38): "lower optim.lr" only when the
run's own updates can have made the values non-finite, "point latest at an older checkpoint" only when the
checkpoint may be damaged, never when it holds another model."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recipes.engines.deepspeed.checkpoints import load_failure_hint
from recipes.reliability.health import NonFiniteTraining

REPO = Path(__file__).resolve().parents[3]


def test_nonfinite_advice_follows_the_cause():
    after = str(NonFiniteTraining(7, ["loss", "ce", "grad_norm"], "step_00000005"))
    assert "Lower optim.lr" in after and "step_00000005 (finite)" in after
    first = str(NonFiniteTraining(6, ["loss", "ce", "grad_norm"], "step_00000005", before_any_update=True))
    assert "the learning rate is not the cause" in first and "optim.lr" not in first
    term = str(NonFiniteTraining(3, ["loss", "term/ntl_mse", "grad_norm"], None))
    assert "numeric term ntl_mse overflowed" in term and "optim.lr" not in term


def test_a_checkpoint_of_another_model_is_not_sent_to_an_older_checkpoint(tmp_path):
    wider = torch.nn.Linear(4, 8).state_dict()
    with pytest.raises(RuntimeError) as mismatch:  # torch's own error for another width
        torch.nn.Linear(4, 4).load_state_dict(wider)
    step = tmp_path / "checkpoints" / "step_00000004"
    hint = load_failure_hint(mismatch.value, step)
    assert "holds another model than this recipe builds" in hint and "latest" not in hint
    assert str(tmp_path / "recipe.yaml") in hint
    damaged = load_failure_hint(RuntimeError("PytorchStreamReader failed reading zip archive"), step)
    assert f"echo step_XXXXXXXX > {tmp_path / 'checkpoints' / 'latest'}" in damaged


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
