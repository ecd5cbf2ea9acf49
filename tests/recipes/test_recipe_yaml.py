"""Reading recipe files (`recipes.recipe_yaml`, `recipes.config`): a duplicate key names itself and both
lines; a tab or any YAML syntax error gives file:line:column and what is wrong, with exit status 2 and no
traceback; `3e-4` is a number, a quoted number is refused for a float setting and for a term weight or
option alike."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from recipes.config import load_recipe, recipe_from_dict

REPO = Path(__file__).resolve().parents[2]
MINIMAL = """\
model:
  config: {model_type: llama}
  tokenizer: tok
data:
  train: data
optim:
  lr: 3e-4
"""


def _write(tmp_path, text: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return path


def test_exponent_numbers_are_floats(tmp_path):
    recipe = load_recipe(_write(tmp_path, MINIMAL), ["optim.eps=1e-6", "loss.objective={terms: {smmd: 3e-1}}"])
    assert recipe.optim.lr == 3e-4 and recipe.optim.eps == 1e-6
    assert recipe.loss.objective.terms["smmd"].weight == 0.3


def test_a_duplicate_key_names_the_key_and_both_lines(tmp_path):
    path = _write(tmp_path, MINIMAL + "  weight_decay: 0.1\n  lr: 1e-3\n")  # lr again, line 9
    with pytest.raises(ValueError) as err:
        load_recipe(path)
    assert str(err.value) == f"{path}:9:3: key 'lr' given twice (first at line 7); YAML would keep the last value " \
                             "silently: keep one"
    with pytest.raises(ValueError, match=r"override 'optim=\{lr: 1, lr: 2\}', its value:1:9: key 'lr' given twice"):
        load_recipe(_write(tmp_path, MINIMAL), ["optim={lr: 1, lr: 2}"])


@pytest.mark.parametrize("text, where, what", [
    (MINIMAL.replace("  lr: 3e-4", "\tlr: 3e-4"), ":7:1:", "a tab character: YAML indents with spaces only"),
    (MINIMAL + "train: {steps: [1, 2}\n", ":8:21:", "expected ',' or ']'"),
    (MINIMAL + "  eps: 1\n    warmup_steps: 3\n", ":9:17:", "mapping values are not allowed here"),
])
def test_yaml_syntax_errors_say_file_line_column_and_what(tmp_path, text, where, what):
    path = _write(tmp_path, text)
    with pytest.raises(ValueError) as err:
        load_recipe(path)
    assert str(err.value).startswith(f"{path}{where} {what}"), str(err.value)


def test_train_and_validate_refuse_a_tab_with_status_2_and_no_traceback(tmp_path):
    path = _write(tmp_path, MINIMAL.replace("  lr: 3e-4", "\tlr: 3e-4"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for module, stream in (("recipes.train", "stderr"), ("recipes.validate", "stdout")):
        proc = subprocess.run([sys.executable, "-m", module, str(path)], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=300)
        out = getattr(proc, stream)
        assert proc.returncode == 2, (module, proc.stdout[-2000:], proc.stderr[-2000:])
        assert f"{path}:7:1: a tab character" in out, (module, out)
        assert "Traceback" not in proc.stdout + proc.stderr


BASE = {"model": {"config": {"model_type": "llama"}, "tokenizer": "tok"}, "data": {"train": "data"}}


@pytest.mark.parametrize("override, message", [
    ("optim.lr='3e-4'", "optim.lr: expected a number, got '3e-4' (a quoted string: write the number without quotes)"),
    ("loss.objective={terms: {smmd: {weight: '3'}}}", "loss.objective.terms.smmd.weight: expected a number, got '3'"),
    ("loss.objective={terms: {smmd: '3'}}", "loss.objective.terms.smmd: expected a weight (a number) or a mapping"),
    ("loss.objective={terms: {smmd: true}}", "loss.objective.terms.smmd: expected a weight (a number) or a mapping"),
    ("loss.objective={terms: {gce: {sigma: '2'}}}", "loss.objective.terms.gce.sigma: expected a number, got '2'"),
    ("loss.objective={terms: {smmd: {rescale_to_ce: 'no'}}}",
     "loss.objective.terms.smmd.rescale_to_ce: expected true/false, got 'no'"),
    ("loss.objective={terms: {smmd: -3}}", "loss.objective.terms.smmd.weight: must be >= 0, got -3.0"),
    ("loss.objective={z_loss: .nan}", "loss.objective.z_loss: must be a finite number, got nan"),
])
def test_a_number_given_as_a_string_is_refused_naming_its_key(override, message):
    with pytest.raises(ValueError) as err:
        recipe_from_dict(BASE, [override])
    assert str(err.value).startswith(message), str(err.value)
