"""Recipe files built on a base: what is inherited, what is replaced, what is never inherited."""

from pathlib import Path

import pytest
import yaml

from recipes.config import load_recipe

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
