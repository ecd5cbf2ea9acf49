"""Issue 27, static part: what a recipe can get wrong is refused before any model is built, by the same
checks in `recipes.validate` and `recipes.train` (`recipes.checks.preflight`).

Each case is a fault a cluster user met: data smaller than one global batch (the loop spun forever),
a non-finite learning rate (a NaN model, exit 0), a negative term weight, NTIL on integers, SMMD's
`sigmas: [0]` or a scalar, data built with another tokenizer of the same size (digits 0 and 1
swapped: trained silently) or a larger one (a bare IndexError at the first forward).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from recipes.config import load_recipe
from recipes.checks import preflight as checks
from recipes.validation import validate as V

REPO = Path(__file__).resolve().parents[3]
DEMO = REPO / "recipes" / "configs" / "demo.yaml"


@pytest.fixture(scope="module")
def base(rec_data_dir, rec_tokenizer_dir):
    """The demo recipe on the 24-row test data: 2 ranks x 4 rows = a global batch of 8, 3 steps an epoch; the
    model's vocabulary sized to the test tokenizer (388 tokens)."""
    return [f"data.train={rec_data_dir}", f"model.tokenizer={rec_tokenizer_dir}", "train.micro_batch_size=4",
            "train.global_batch_size=8", "train.steps=3", "data.eval=null", "model.config.vocab_size=512"]


@pytest.fixture(scope="module")
def swapped_tokenizer(tmp_path_factory, rec_tokenizer_dir):
    """The test tokenizer with the ids of "0" and "1" swapped: same size, other ids."""
    out = tmp_path_factory.mktemp("swapped") / "tok"
    shutil.copytree(rec_tokenizer_dir, out)
    spec = json.loads((out / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["0"], vocab["1"] = vocab["1"], vocab["0"]
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return out


def _errors(overrides, *extra):
    rep = V.validate_recipe(DEMO, [*overrides, *extra], offline=True, size=False)
    return rep


def test_the_checked_recipe_passes(base):
    rep = _errors(base)
    assert rep.ok and not rep.warnings, rep.render()
    assert checks.preflight(load_recipe(DEMO, base), world_size=2) == [
        "3 steps x 8 rows = 1 epochs of 24 rows (3 steps each)"]


def test_fewer_rows_than_one_global_batch_is_refused(base):
    """The issue's hang: 24 rows, a global batch of 64. validate says it; train refuses on every rank."""
    overrides = [*base, "train.micro_batch_size=32", "train.global_batch_size=64"]
    rep = _errors(overrides)
    assert any("holds 24 rows, fewer than one global batch of 64" in e for e in rep.errors), rep.errors
    with pytest.raises(checks.RecipeCheckError, match="fewer than one global batch of 64"):
        checks.preflight(load_recipe(DEMO, overrides), world_size=2)


def test_steps_beyond_the_stated_epochs_are_refused_and_repeats_are_said(base):
    rep = _errors(base, "train.steps=10")  # 3 steps an epoch: 3.33 passes, none stated
    assert rep.ok and any("repeat" in w and "3.33 times" in w for w in rep.warnings), rep.render()
    rep = _errors(base, "train.steps=10", "train.max_epochs=2")
    assert any(e.startswith("train.steps: 10 steps take 3.33 passes") and "lower train.steps to 6" in e
               for e in rep.errors), rep.errors
    assert _errors(base, "train.steps=10", "train.max_epochs=4").ok


def test_data_of_another_tokenizer_is_refused_unless_allowed(base, swapped_tokenizer):
    overrides = [*base, f"model.tokenizer={swapped_tokenizer}"]
    rep = _errors(overrides)
    assert any("was built with another tokenizer" in e and "allow_tokenizer_mismatch" in e for e in rep.errors), \
        rep.errors
    with pytest.raises(checks.RecipeCheckError, match="another tokenizer"):
        checks.preflight(load_recipe(DEMO, overrides), world_size=2)
    allowed = [*overrides, "data.allow_tokenizer_mismatch=true"]
    rep = _errors(allowed)
    assert rep.ok and any("another tokenizer" in w for w in rep.warnings), rep.render()


def test_data_of_a_larger_tokenizer_is_refused_even_when_allowed(base, rec_data_dir, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(rec_data_dir, data)
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["tokenizer"]["length"] += 100
    manifest["tokenizer"]["fingerprint"] = "0" * 64
    (data / "manifest.json").write_text(json.dumps(manifest))
    rep = _errors(base, f"data.train={data}", "data.allow_tokenizer_mismatch=true")
    assert any("index past the model's embedding" in e for e in rep.errors), rep.errors


@pytest.mark.parametrize("override, key", [
    ("optim.lr=.inf", "optim.lr: must be a finite number"),
    ("optim.lr=.nan", "optim.lr: must be a finite number"),
    ("optim.eps=0", "optim.eps: must be > 0"),
    ("optim.betas=[0.9, 1.5]", "optim.betas"),
    ("loss.objective={terms: {smmd: -3}}", "loss.objective.terms.smmd.weight: must be >= 0"),
    ("loss.objective={terms: {smmd: {sigmas: [0]}}}", "loss.objective.terms.smmd.sigmas"),
    ("loss.objective={terms: {smmd: {sigmas: 2.0}}}", "loss.objective.terms.smmd.sigmas: expected a non-empty list"),
])
def test_non_finite_and_negative_settings_do_not_load(base, override, key):
    rep = _errors(base, override)
    assert rep.numbers.get("load_error") and key in rep.errors[0], rep.errors


def test_ntil_on_a_non_digits_policy_is_refused_by_both(base):
    overrides = [*base, "loss.numeric_policy=integers", "loss.objective={terms: {ntil: 0.3}}"]
    rep = _errors(overrides)
    assert any(e.startswith("loss.objective.terms.ntil") for e in rep.errors)
    with pytest.raises(checks.RecipeCheckError, match="NTIL needs loss.numeric_policy digits"):
        checks.preflight(load_recipe(DEMO, overrides), world_size=2)


def test_train_refuses_before_building_anything(base, tmp_path):
    """`python -m recipes.train` on data smaller than one global batch: exit 2 in seconds with the
    reason, no model built, nothing written into train.out_dir (it used to spin at 100% CPU forever)."""
    out = tmp_path / "run"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "recipes.train", str(DEMO), *base, "train.micro_batch_size=32",
                           "train.global_batch_size=null", f"train.out_dir={out}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "fewer than one global batch of 32" in proc.stderr, proc.stderr[-3000:]
    assert not out.exists()
