"""`loss.plugins`: a term registered in a user's module (tests/recipes/plugin_helpers.py writes it into a
temporary folder) reaches a recipe through loading, and so every entry point:

- loading imports the plugins before the objective is read; the typed objective holds the user's term
  with its default weight and options; a bad plugin (not a module name, not found, its import fails, a
  registration numloss refuses, no term registered) is a ValueError naming `loss.plugins[i]`, and a failed
  import leaves the registry as it was; an unknown term's error names what the plugins registered;
- `python -m recipes.train` refuses a bad plugin with exit 2 before anything is built or written;
  `recipes.validate` reports it (exit 2) and validates a good one;
- a changed plugin list on resume is a training change (applied from the next step);
- torchrun, 2 gloo ranks, DeepSpeed ZeRO-3 and Megatron (DP 2): step 1 logs `term/abs_error` equal to its
  float64 reference on the starting weights (a Hugging Face forward of every row of the step), and
  loss = CE + 0.5 x the term.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.recipes import plugin_helpers
from tests.recipes.torchrun_helpers import REPO, read_metrics, run_to_end, save_tiny_llama


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    root = plugin_helpers.write_package(tmp_path / "user_code")
    monkeypatch.syspath_prepend(str(root))
    yield root
    plugin_helpers.forget_package()


def _recipe(root: Path, **loss) -> dict:
    return {"name": "plugins", "model": {"config": {"model_type": "llama"}, "tokenizer": "unused"},
            "data": {"train": str(root / "data")}, "train": {"out_dir": str(root / "out")},
            "loss": {"plugins": [plugin_helpers.MODULE],
                     "objective": {"terms": {plugin_helpers.TERM: {"power": 2.0}}}, **loss}}


def test_a_plugin_registers_its_term_before_the_objective_is_read(plugin_dir, tmp_path):
    from recipes.config import dump_recipe, load_recipe

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(_recipe(tmp_path)))
    recipe = load_recipe(path)
    term = recipe.loss.objective.terms[plugin_helpers.TERM]
    assert (term.weight, term.options) == (plugin_helpers.WEIGHT, {"power": 2.0})
    assert recipe.loss.plugins == [plugin_helpers.MODULE]
    assert recipe.to_dict()["loss"]["plugins"] == [plugin_helpers.MODULE]
    # loaded again (a second entry point in the same process, the recipe.yaml a run writes): the same
    dump_recipe(recipe, tmp_path / "dumped.yaml")
    again = load_recipe(tmp_path / "dumped.yaml")
    assert again.loss.objective == recipe.loss.objective and again.loss.plugins == [plugin_helpers.MODULE]
    # its options are checked as a built-in term's are
    with pytest.raises(ValueError, match=rf"loss\.objective\.terms\.{plugin_helpers.TERM}\.power: "):
        load_recipe(path, ["loss.objective={terms: {abs_error: {power: 0}}}"])


@pytest.mark.parametrize("plugin, message", [
    ("numloss_user_terms/terms", r"'numloss_user_terms/terms' is not a module name"),
    ("numloss_user_terms.missing", r"no module named 'numloss_user_terms.missing' here .*PYTHONPATH"),
    ("numloss_no_such_package.terms", r"no module named 'numloss_no_such_package.terms' here"),
    ("numloss_user_terms.broken", r"importing 'numloss_user_terms.broken' failed: ModuleNotFoundError: No module "
                                  r"named 'numloss_missing_dependency' \(.*broken.py:1\)"),
    ("numloss_user_terms.refused", r"importing 'numloss_user_terms.refused' failed: ValueError: "
                                   r"register_term\('Abs'\): a term's name is lower-case .*refused.py:4\)"),
    ("numloss_user_terms.silent", r"'numloss_user_terms.silent' registers no term"),
])
def test_a_bad_plugin_is_refused_naming_its_key(plugin_dir, tmp_path, plugin, message):
    from numloss.losses import registered_terms
    from recipes.config import recipe_from_dict

    builtin = registered_terms()
    with pytest.raises(ValueError, match=r"^loss\.plugins\[0\]: " + message):
        recipe_from_dict(_recipe(tmp_path, plugins=[plugin], objective={}))
    assert registered_terms() == builtin  # a failed import registered nothing ('refused' had registered abs_error)
    with pytest.raises(ValueError, match=r"^loss\.plugins\[1\]: " + message):  # after a good one: its index
        recipe_from_dict(_recipe(tmp_path, plugins=[plugin_helpers.MODULE, plugin]))
    assert registered_terms() == [*builtin, plugin_helpers.TERM]
    assert recipe_from_dict(_recipe(tmp_path)).loss.objective.terms[plugin_helpers.TERM].weight == plugin_helpers.WEIGHT


def test_an_unknown_term_says_what_the_plugins_registered(plugin_dir, tmp_path):
    from recipes.config import recipe_from_dict

    with pytest.raises(ValueError, match=r"loss\.objective\.terms\.abs_err: unknown term; .*; loss.plugins registered "
                                         r"\{'numloss_user_terms.terms': \('abs_error',\)\}"):
        recipe_from_dict(_recipe(tmp_path, objective={"terms": {"abs_err": {}}}))
    with pytest.raises(ValueError, match=r"unknown term; .*name the module that registers it in loss.plugins"):
        recipe_from_dict(_recipe(tmp_path, plugins=[], objective={"terms": {"not_registered": {}}}))


def test_import_roots_name_the_plugins_folder_but_not_installed_or_project_code(plugin_dir):
    from recipes.plugins import import_plugins, import_roots

    import_plugins([plugin_helpers.MODULE])
    assert import_roots([plugin_helpers.MODULE, "yaml", "recipes.config"]) == [str(plugin_dir.resolve())]


def test_a_changed_plugin_list_is_applied_on_resume_as_a_change_of_the_objective(plugin_dir, tmp_path):
    from recipes.config import recipe_from_dict
    from recipes.reliability.resume_policy import TRAINING, recipe_changes

    old = recipe_from_dict(_recipe(tmp_path, objective={})).to_dict()
    new = recipe_from_dict(_recipe(tmp_path, plugins=[])).to_dict()
    del old["loss"]["objective"], new["loss"]["objective"]
    [change] = recipe_changes(old, new)
    assert (change.key, change.old, change.new, change.kind) == ("loss.plugins", [plugin_helpers.MODULE], [], TRAINING)


def test_train_refuses_a_bad_plugin_with_exit_2_before_anything_is_written(tmp_path):
    root = plugin_helpers.write_package(tmp_path / "user_code")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(_recipe(tmp_path, plugins=[f"{plugin_helpers.PACKAGE}.silent"])))
    env = {**os.environ, "PYTHONPATH": str(root), "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "recipes.train", str(recipe)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"loss.plugins[0]: '{plugin_helpers.PACKAGE}.silent' registers no term" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_validate_imports_the_plugins(plugin_dir, tmp_path):
    from recipes.validation.validate import main, validate_recipe

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(_recipe(tmp_path)))
    report = validate_recipe(path, size=False, recommend=False)
    assert not report.numbers.get("load_error") and not [e for e in report.errors if "loss." in e], report.errors
    assert main([str(path), f"loss.plugins=[{plugin_helpers.PACKAGE}.silent]", "--offline"]) == 2


# ---- training through torchrun ------------------------------------------------------------------------

ROWS = 8  # the data holds exactly one global batch: step 1 trains on every row


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    import pyarrow.parquet as pq

    from data_prep.shards import read_manifest
    from data_prep.sources.base import SourceConfig
    from recipes.experiments.tiny import build_plain_shards, train_tokenizer

    root = tmp_path_factory.mktemp("plugins")
    plugin_helpers.write_package(root / "user_code")
    train_tokenizer(["Calculate 0123456789 + - * / = . ( )"], root / "tok", "digits")
    build_plain_shards(SourceConfig(kind="arithmetic", options={"module": "add_or_sub", "n": ROWS, "max_digits": 3,
                                                                "negatives": False}), root / "tok", root / "data")
    save_tiny_llama(root / "tok", root / "model")
    shards = read_manifest(root / "data")["shards"]
    rows = [r for s in shards for r in pq.read_table(root / "data" / s["file"], columns=["input_ids", "labels"]).to_pylist()]
    assert len(rows) == ROWS
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "plugins", "model": {"name_or_path": str(root / "model"), "dtype": "float32"},
        "data": {"train": str(root / "data")},
        "loss": {"plugins": [plugin_helpers.MODULE], "objective": {"terms": {plugin_helpers.TERM: {}}}},
        "optim": {"lr": 1e-3},
        "train": {"steps": 1, "micro_batch_size": 2, "grad_accum": 2, "export": False, "progress": False,
                  "tensorboard": False}}))
    return root, recipe, rows


def _reference(root: Path, rows: list[dict]) -> float:
    """The term over every row of the step, from the definition in float64 on the starting weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(root / "model"))
    digits = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
    model = AutoModelForCausalLM.from_pretrained(str(root / "model"), dtype=torch.float64).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            logits = model(input_ids=torch.tensor([row["input_ids"]])).logits[0]
            s, n = plugin_helpers.reference(logits[:-1], torch.tensor(row["labels"][1:]), digits)
            total, count = total + s, count + n
    assert count > ROWS  # every row's answer has digits
    return total / count


ENGINES = ["deepspeed"] + (["megatron"] if importlib.util.find_spec("megatron.core") else [])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("engine", ENGINES)
def test_a_plugin_term_trains_through_torchrun(workspace, engine):
    pytest.importorskip("deepspeed")
    root, recipe, rows = workspace
    out = root / engine
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(root / "user_code"), os.environ.get("PYTHONPATH")]))}
    run_to_end(recipe, out, f"train.engine={engine}", env=env)
    [row] = read_metrics(out)
    want = _reference(root, rows)
    assert row[f"term/{plugin_helpers.TERM}"] == pytest.approx(want, rel=1e-5)
    user_term = plugin_helpers.WEIGHT * row[f"term/{plugin_helpers.TERM}"]
    assert row["loss"] == pytest.approx(row["ce"] + user_term, rel=1e-6)
    assert yaml.safe_load((out / "recipe.yaml").read_text())["loss"]["plugins"] == [plugin_helpers.MODULE]
