"""recipes.config, the typed recipe.

- Recipe files built on a base: what is inherited, what is replaced, what is never inherited.
- `loss.objective` is numloss's typed `ObjectiveConfig` from the moment the recipe loads, read once and
  carried as it is to the resume policy and the engine; the recipe's dump still writes it as the file
  wrote it, so recipe.yaml and a checkpoint's recipe.json hold the same mapping as before.
- Non-finite and negative optimizer settings and bad term weights and options do not load.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import yaml

from numloss import ObjectiveConfig
from recipes.config import Recipe, dump_recipe, load_recipe, recipe_from_dict
from recipes.validation.validate import validate_recipe
from tests.distributed import run_ranks

CONFIGS = Path(__file__).resolve().parents[2] / "recipes" / "configs"


def _write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


BASE = {"name": "base-run", "model": {"config": {"model_type": "llama", "hidden_size": 8}, "tokenizer": "tok",
                                      "dtype": "float32"},
        "data": {"train": "data/train", "eval": "data/test", "seq_len": 64},
        "loss": {"objective": {"terms": {"smmd": {}, "ntl_was": 0.3}}, "head": "chunked"},
        "optim": {"lr": 1e-4, "warmup_steps": 5},
        "train": {"steps": 10, "out_dir": "runs/base-run", "seed": 3}}


def test_a_child_merges_sections_key_by_key_and_replaces_values_whole(tmp_path):
    _write(tmp_path / "base.yaml", BASE)
    child = _write(tmp_path / "child.yaml", {"base": "base.yaml", "optim": {"lr": 3e-4},
                                             "loss": {"objective": {"terms": {"ntil": 0.3}}},
                                             "data": {"eval": None}})
    r = load_recipe(child)
    assert (r.optim.lr, r.optim.warmup_steps) == (3e-4, 5)            # section merged key by key
    assert set(r.loss.objective.terms) == {"ntil"}                 # a value replaces the base's whole
    assert r.loss.head == "chunked" and r.data.train == "data/train" and r.data.eval is None
    assert r.model.config == {"model_type": "llama", "hidden_size": 8} and r.train.seed == 3
    # identity is the child's own: its stem, and runs/<name> since it names no out_dir of its own
    assert r.name == "child" and r.train.out_dir == "runs/child"
    # command-line overrides come last
    r = load_recipe(child, ["optim.warmup_steps=0", "train.out_dir=elsewhere"])
    assert r.optim.warmup_steps == 0 and r.train.out_dir == "elsewhere" and r.optim.lr == 3e-4
    # the base alone is unchanged
    b = load_recipe(tmp_path / "base.yaml")
    assert b.name == "base-run" and b.train.out_dir == "runs/base-run" and b.optim.lr == 1e-4


def test_bases_chain_and_bad_chains_are_errors_naming_the_files(tmp_path):
    _write(tmp_path / "a.yaml", BASE)
    (tmp_path / "sub").mkdir()
    _write(tmp_path / "sub" / "b.yaml", {"base": "../a.yaml", "train": {"steps": 20}})
    c = _write(tmp_path / "sub" / "c.yaml", {"base": "b.yaml", "optim": {"lr": 1e-5}, "name": "cee",
                                             "train": {"out_dir": "runs/c"}})
    r = load_recipe(c)
    assert (r.train.steps, r.optim.lr, r.optim.warmup_steps, r.name, r.train.out_dir) == \
        (20, 1e-5, 5, "cee", "runs/c")

    _write(tmp_path / "x.yaml", {"base": "y.yaml"})
    _write(tmp_path / "y.yaml", {"base": "x.yaml"})
    with pytest.raises(ValueError, match=r"base cycle .*x.yaml -> .*y.yaml -> .*x.yaml"):
        load_recipe(tmp_path / "x.yaml")
    _write(tmp_path / "orphan.yaml", {"base": "missing.yaml"})
    with pytest.raises(FileNotFoundError, match=r"missing.yaml \(the base of .*orphan.yaml\)"):
        load_recipe(tmp_path / "orphan.yaml")
    _write(tmp_path / "typo.yaml", {"base": "a.yaml", "optim": {"lrr": 1.0}})
    with pytest.raises(ValueError, match=r"typo.yaml: unknown key optim.lrr"):
        load_recipe(tmp_path / "typo.yaml")


def _without_identity_and_objective(d: dict) -> dict:
    return {**d, "name": None, "loss": {**d["loss"], "objective": None}, "train": {**d["train"], "out_dir": None}}


@pytest.mark.parametrize("family, losses", [
    ("qwen2.5-1.5b-gsm8k", ("dist2", "gce", "ntil", "ntl", "smmd")),
    ("llama3-8b-gsm8k", ("smmd",)),
])
def test_shipped_loss_recipes_differ_from_their_baseline_only_in_objective_and_identity(family, losses):
    ce = load_recipe(CONFIGS / family / "ce.yaml").to_dict()
    outs = {ce["train"]["out_dir"]}
    for loss in losses:
        other = load_recipe(CONFIGS / family / f"{loss}.yaml").to_dict()
        assert other["loss"]["objective"]["terms"] and other["name"] == f"{family}-{loss}"
        outs.add(other["train"]["out_dir"])
        assert _without_identity_and_objective(other) == _without_identity_and_objective(ce), loss
    assert len(outs) == len(losses) + 1  # every run has its own directory


# ---- loss.objective: typed once ------------------------------------------------------------------------

OBJECTIVE = {"terms": {"smmd": {}, "ntl_was": 0.5, "gce": {"weight": 1, "sigma": 2.0}}, "z_loss": 0}
RECIPE = {"name": "typed", "model": {"config": {"model_type": "llama"}, "tokenizer": "tok"},
          "data": {"train": "data"}, "loss": {"objective": OBJECTIVE, "numeric_policy": "integers"}}
# The loss section of this recipe's `to_dict()` as the code wrote it while the objective was a plain
# mapping: what recipe.yaml and recipe.json of checkpoints saved before hold.
LOSS_BEFORE = {"objective": {"terms": {"smmd": {}, "ntl_was": 0.5, "gce": {"weight": 1, "sigma": 2.0}}, "z_loss": 0},
               "numeric_policy": "integers", "numeric_max_value": 999, "space_variants": False, "head": "logits",
               "chunk_size": 1024, "router_aux_coeff": None}


def _counting_from_dict(calls: list):
    """`ObjectiveConfig.from_dict` that records the mapping of every call (subclasses included)."""
    original = ObjectiveConfig.from_dict.__func__

    def from_dict(cls, config, root="objective"):
        calls.append(json.loads(json.dumps(config)))
        return original(cls, config, root)

    return classmethod(from_dict)


def test_the_objective_is_typed_once_when_the_recipe_loads(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(ObjectiveConfig, "from_dict", _counting_from_dict(calls))
    recipe = load_recipe(_write(tmp_path / "r.yaml", RECIPE))
    assert calls == [OBJECTIVE]
    objective = recipe.loss.objective
    assert isinstance(objective, ObjectiveConfig)
    assert {name: term.weight for name, term in objective.terms.items()} == {"smmd": 3.0, "ntl_was": 0.5, "gce": 1.0}
    assert objective.terms["gce"].options == {"sigma": 2.0} and objective.z_loss == 0.0
    assert set(Recipe().loss.objective.terms) == set()  # no loss.objective: plain CE, typed too


@pytest.mark.parametrize("override, message", [
    ("loss.objective.terms.smmd.sigmas=[0]", "loss.objective.terms.smmd.sigmas"),
    ("loss.objective.terms.smmd.sigmaz=[1.0]", "loss.objective.terms.smmd.sigmaz: no such option of smmd"),
    ("loss.objective.terms.smmd2={}", "loss.objective.terms.smmd2: unknown term"),
    ("loss.objective.scale=2", "loss.objective.scale: unknown key"),
    ("loss.objective=[smmd]", "loss.objective: expected a mapping"),
])
def test_strict_errors_name_the_key_under_loss_objective(override, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        recipe_from_dict(RECIPE, [override])


@pytest.mark.parametrize("override, key", [
    ("optim.lr=.inf", "optim.lr: must be a finite number"),
    ("optim.lr=.nan", "optim.lr: must be a finite number"),
    ("optim.eps=0", "optim.eps: must be > 0"),
    ("optim.betas=[0.9, 1.5]", "optim.betas"),
    ("loss.objective={terms: {smmd: -3}}", "loss.objective.terms.smmd.weight: must be >= 0"),
    ("loss.objective={terms: {smmd: {sigmas: [0]}}}", "loss.objective.terms.smmd.sigmas"),
    ("loss.objective={terms: {smmd: {sigmas: 2.0}}}", "loss.objective.terms.smmd.sigmas: expected a non-empty list"),
])
def test_non_finite_and_negative_settings_do_not_load(demo_on_test_data, override, key):
    """Refused when the recipe loads (`Recipe.validate`, numloss's `ObjectiveConfig` for the terms);
    `recipes.validate` reports it as its first error."""
    rep = validate_recipe(CONFIGS / "demo.yaml", [*demo_on_test_data, override], offline=True, size=False)
    assert rep.numbers.get("load_error") and key in rep.errors[0], rep.errors


@pytest.mark.parametrize("override, value, said", [
    ("optim.lr=1e40", 1e40, "optim.lr: must be a finite float32 number"),
    ("optim.grad_clip=1e39", 1e39, "optim.grad_clip: must be a finite float32 number"),
    ("optim.weight_decay=1e39", 1e39, "optim.weight_decay: must be a finite float32 number"),
    ("optim.eps=1e-50", 1e-50, "optim.eps: must be > 0 in float32"),
    ("loss.router_aux_coeff=1e39", 1e39, "loss.router_aux_coeff: must be a finite float32 number"),
    ("loss.objective={terms: {smmd: 1.0e+39}}", 1e39,
     "loss.objective.terms.smmd.weight: must be a finite float32 number"),
    ("loss.objective={terms: {smmd: {sigmas: [1.0e-50]}}}", 1e-50,
     "loss.objective.terms.smmd.sigmas: every entry must be a finite float32 number > 0"),
])
def test_numbers_are_checked_in_the_float32_they_train_in(tmp_path, capsys, monkeypatch, override, value, said):
    """Finite in float64 but inf (or 0) in float32, the dtype of the losses and the optimizer's state under
    either model.dtype: refused when `python -m recipes.train` loads the recipe (exit 2), in one line naming
    the key; the boundary, float32's largest number, loads."""
    import torch

    from recipes.train import main as train_main

    assert math.isfinite(value) and torch.tensor(value, dtype=torch.float32).item() in (math.inf, 0.0)
    recipe = _write(tmp_path / "r.yaml", {**RECIPE, "model": {**RECIPE["model"], "dtype": "float32"}})
    with pytest.raises(SystemExit) as stop:
        train_main([str(recipe), f"train.out_dir={tmp_path / 'run'}", override])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith(f"[numloss] recipe {recipe}: {said}") and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()
    monkeypatch.setenv("RANK", "1")  # under torchrun: rank 0 alone says it (N copies would bury it), every rank exits 2
    with pytest.raises(SystemExit) as stop:
        train_main([str(recipe), f"train.out_dir={tmp_path / 'run'}", override])
    assert stop.value.code == 2 and capsys.readouterr().err == ""
    largest = torch.finfo(torch.float32).max
    assert recipe_from_dict(RECIPE, [f"optim.lr={largest!r}", f"optim.grad_clip={largest!r}"]).optim.lr == largest


def test_the_dump_is_the_recipe_as_written(tmp_path):
    recipe = load_recipe(_write(tmp_path / "r.yaml", RECIPE))
    data = recipe.to_dict()
    assert data["loss"] == {**LOSS_BEFORE, "plugins": []}  # and the section's key added since, loss.plugins
    for key, value in data.items():  # every other section as dataclasses.asdict gives it, as before
        if key != "loss":
            section = getattr(recipe, key)
            assert value == (dataclasses.asdict(section) if dataclasses.is_dataclass(section) else section), key
    dump_recipe(recipe, tmp_path / "recipe.yaml")
    assert yaml.safe_load((tmp_path / "recipe.yaml").read_text()) == data
    again = load_recipe(tmp_path / "recipe.yaml")
    assert again.to_dict() == data  # a dump reads back as the same recipe
    assert again.loss.objective == recipe.loss.objective
    assert Recipe().to_dict()["loss"]["objective"] == {}  # the default, as the plain mapping was
    # an objective set from code dumps every field as numloss resolves it, which reads back as itself
    recipe.loss.objective = ObjectiveConfig.from_dict({"terms": {"dist2": {"tau": 2.0}}})
    written = recipe.to_dict()["loss"]["objective"]
    assert written["terms"]["dist2"] == {"weight": 0.1, "options": {"tau": 2.0}, "rescale_to_ce": False}
    assert recipe_from_dict({**RECIPE, "loss": {"objective": written}}).loss.objective == recipe.loss.objective
    recipe.loss.objective = ObjectiveConfig()
    assert recipe.to_dict()["loss"]["objective"] == {}


def test_a_checkpoint_saved_before_compares_equal_key_by_key(tmp_path):
    from recipes.reliability.resume_policy import decide, recipe_changes

    recipe = recipe_from_dict(RECIPE, [f"train.out_dir={tmp_path}"])
    saved = json.loads(json.dumps({**recipe.to_dict(), "loss": LOSS_BEFORE}))  # as recipe.json holds it
    assert recipe_changes(saved, recipe.to_dict()) == []
    plan = decide(recipe, "step_00000001", saved, tmp_path)
    assert plan.changes == [] and not plan.finished


def _load_resume_build(rank, world, assets, out):
    """In one gloo rank: load a recipe, decide its resume against a checkpoint's recipe with another
    SMMD weight, build the DeepSpeed engine; count every reading of an objective mapping."""
    from numloss import ObjectiveConfig
    from recipes.config import load_recipe
    from recipes.engines.deepspeed.runtime.engine import DeepSpeedEngine
    from recipes.reliability.checkpoints import CheckpointDirs
    from recipes.reliability.resume_policy import decide
    from tests.recipes.engines.megatron import engine_helpers as H

    out = Path(out)
    runtime = H.gloo_rank_runtime(rank, world)
    objective = {"terms": {"smmd": {}, "ntl_was": {}}}
    data = {"name": "once", "model": {"name_or_path": assets["model"], "tokenizer": assets["tokenizer"],
                                      "dtype": "float32"},
            "data": {"train": "unused"}, "loss": {"objective": objective},
            "deepspeed": {"zero_stage": 2}, "train": {"steps": 3, "micro_batch_size": 2, "out_dir": str(out),
                                                      "export": False}}
    saved = json.loads(json.dumps({**data, "loss": {"objective": {"terms": {"smmd": {"weight": 1.0}, "ntl_was": {}}}}}))
    calls = []
    ObjectiveConfig.from_dict = _counting_from_dict(calls)  # this rank's process only
    recipe = load_recipe(_write(out / "once.yaml", data))
    plan = decide(recipe, "step_00000001", saved, out)
    assert [(c.key, c.old, c.new) for c in plan.changes] == [("loss.objective.terms.smmd.weight", 1.0, 3.0)]
    engine = DeepSpeedEngine(recipe, runtime, CheckpointDirs(out, 1, runtime))
    try:
        assert engine.wrapper.objective.config is recipe.loss.objective  # carried, not read again
        # one reading of the recipe's own objective (at load); the other is the checkpoint's recipe
        assert calls == [objective, saved["loss"]["objective"]], calls
    finally:
        engine.close()


def test_load_resume_and_engine_build_read_the_objective_once(tmp_path):
    from tests.recipes.engines.megatron import engine_helpers as H

    assets = H.make_assets(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    run_ranks(1, _load_resume_build, assets, str(out), timeout=300)
