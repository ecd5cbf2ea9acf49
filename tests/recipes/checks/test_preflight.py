"""recipes.checks.preflight: what a recipe can get wrong is refused before any model is built, by the same
checks in `recipes.validate` and `recipes.train` (`preflight`, on every rank: one error listing every
problem, exit status 2).

Each case is a fault a cluster user would otherwise meet late: data smaller than one global batch (the
loop would spin on empty epochs forever), `train.steps` beyond the stated epochs, data built with another
tokenizer of the same size (digits 0 and 1 swapped: it would train silently) or a larger one (a bare
IndexError at the first forward). `python -m recipes.train` exits 2 within seconds, builds no engine and
writes nothing, listing every error at once: out_dir naming a file, a vocabulary and positions that do
not fit the data (a tiny Llama config against data built with a Llama-3-sized tokenizer).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from recipes.checks import preflight as checks
from recipes.config import load_recipe
from recipes.validation.validate import validate_recipe
from tests.recipes.checks.helpers import REPO, llama3_recipe

DEMO = REPO / "recipes" / "configs" / "demo.yaml"


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
    rep = validate_recipe(DEMO, [*overrides, *extra], offline=True, size=False)
    return rep


def test_the_checked_recipe_passes(demo_on_test_data):
    rep = _errors(demo_on_test_data)
    assert rep.ok and not rep.warnings, rep.render()
    assert checks.preflight(load_recipe(DEMO, demo_on_test_data), world_size=2) == [
        "3 steps x 8 rows = 1 epochs of 24 rows (3 steps each)"]


def test_fewer_rows_than_one_global_batch_is_refused(demo_on_test_data):
    """24 rows, a global batch of 64: unchecked, the loop would spin on epochs of no step. validate says it;
    train refuses on every rank."""
    overrides = [*demo_on_test_data, "train.micro_batch_size=32", "train.global_batch_size=64"]
    rep = _errors(overrides)
    assert any("holds 24 rows, fewer than one global batch of 64" in e for e in rep.errors), rep.errors
    with pytest.raises(checks.RecipeCheckError, match="fewer than one global batch of 64"):
        checks.preflight(load_recipe(DEMO, overrides), world_size=2)


def test_steps_beyond_the_stated_epochs_are_refused_and_repeats_are_said(demo_on_test_data):
    rep = _errors(demo_on_test_data, "train.steps=10")  # 3 steps an epoch: 3.33 passes, none stated
    assert rep.ok and any("repeat" in w and "3.33 times" in w for w in rep.warnings), rep.render()
    rep = _errors(demo_on_test_data, "train.steps=10", "train.max_epochs=2")
    assert any(e.startswith("train.steps: 10 steps take 3.33 passes") and "lower train.steps to 6" in e
               for e in rep.errors), rep.errors
    assert _errors(demo_on_test_data, "train.steps=10", "train.max_epochs=4").ok


def test_data_of_another_tokenizer_is_refused_unless_allowed(demo_on_test_data, swapped_tokenizer):
    overrides = [*demo_on_test_data, f"model.tokenizer={swapped_tokenizer}"]
    rep = _errors(overrides)
    assert any("was built with another tokenizer" in e and "allow_tokenizer_mismatch" in e for e in rep.errors), \
        rep.errors
    with pytest.raises(checks.RecipeCheckError, match="another tokenizer"):
        checks.preflight(load_recipe(DEMO, overrides), world_size=2)
    allowed = [*overrides, "data.allow_tokenizer_mismatch=true"]
    rep = _errors(allowed)
    assert rep.ok and any("another tokenizer" in w for w in rep.warnings), rep.render()


def test_data_of_a_larger_tokenizer_is_refused_even_when_allowed(demo_on_test_data, rec_data_dir, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(rec_data_dir, data)
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["tokenizer"]["length"] += 100
    manifest["tokenizer"]["fingerprint"] = "0" * 64
    (data / "manifest.json").write_text(json.dumps(manifest))
    rep = _errors(demo_on_test_data, f"data.train={data}", "data.allow_tokenizer_mismatch=true")
    assert any("index past the model's embedding" in e for e in rep.errors), rep.errors


def test_train_refuses_before_building_anything(demo_on_test_data, tmp_path):
    """`python -m recipes.train` on data smaller than one global batch: exit 2 in seconds with the
    reason, no model built, nothing written into train.out_dir (unchecked, it would spin at 100% CPU forever)."""
    out = tmp_path / "run"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "recipes.train", str(DEMO), *demo_on_test_data,
                           "train.micro_batch_size=32", "train.global_batch_size=null", f"train.out_dir={out}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "fewer than one global batch of 32" in proc.stderr, proc.stderr[-3000:]
    assert not out.exists()


def test_the_recipe_passes(llama3_data):
    lines = checks.preflight(llama3_recipe(llama3_data), 2, tokenizer=llama3_data["tokenizer"])
    assert lines == ["3 steps x 8 rows = 1 epochs of 24 rows (3 steps each)"]


def test_train_refuses_all_of_them_at_once_with_status_2_before_building_anything(llama3_data, tmp_path):
    """`python -m recipes.train` lists every error, exits 2 within seconds, builds no engine and writes
    nothing: out_dir names a file (left as it was), the vocabulary and positions do not fit the data."""
    (tmp_path / "recipe.yaml").write_text(json.dumps({
        "model": {"config": {"model_type": "llama", "vocab_size": 128000, "hidden_size": 16, "intermediate_size": 32,
                             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                             "max_position_embeddings": 16}, "tokenizer": llama3_data["tok"], "dtype": "float32"},
        "data": {"train": str(llama3_data["data"]), "seq_len": 8}, "train": {"steps": 2, "micro_batch_size": 4}}))
    (tmp_path / "out").write_text("a file\n")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    started = time.time()
    proc = subprocess.run([sys.executable, "-m", "recipes.train", str(tmp_path / "recipe.yaml"),
                           f"train.out_dir={tmp_path / 'out'}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    for key in (f"train.out_dir: {tmp_path / 'out'} is a file", "model.tokenizer: 128256 tokens", "data.seq_len: 8 is "
                "shorter than the longest row", "is outside the model's vocabulary [0, 128000)",
                "more than the model's 16 (max_position_embeddings 16)"):
        assert key in proc.stderr, (key, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr and "[numloss] engine" not in proc.stdout
    assert (tmp_path / "out").read_text() == "a file\n"
    assert time.time() - started < 120
