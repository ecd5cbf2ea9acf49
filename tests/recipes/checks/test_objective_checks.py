"""recipes.checks.objective_checks: what a term's registered needs ask of the model's tokenizer, before any
model is built. DEL (the ten digits, the decimal point) and NTIL (digits) against tokenizers trained here:
digit-level with a "." token, digit-level without one, Llama-3-style groups of three digits (its
vocabulary holds the ten digits, so the digits policy finds them, but numbers are written in groups), and
one that merges a digit with the point ("5."); a user's term that needs digits is judged by its
registration alike; a numeric policy that cannot serve DEL is refused by the recipe alone, and NTIL on
a policy other than digits by `recipes.validate` and `preflight` alike.
`python -m recipes.train` refuses DEL on the groups-of-three tokenizer with exit 2 before anything is
built or written."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from recipes.checks import preflight
from recipes.config import load_recipe, recipe_from_dict
from recipes.validation.validate import validate_recipe
from tests.recipes.torchrun_helpers import REPO

DEMO = REPO / "recipes" / "configs" / "demo.yaml"
TEXTS = ["Calculate 0123456789 + - * / = . ( )", "12345.678 is 1.5 and 0.25"]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from recipes.experiments.tiny import train_tokenizer
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("objective_checks")
    found = {"digits": train_tokenizer(TEXTS, root / "digits", "digits"),
             "no_point": train_tokenizer(["0123456789 + - * / = ( )"], root / "no_point", "digits"),
             "groups3": train_tokenizer(TEXTS, root / "groups3", "groups3")}
    # a digit followed by "." is one piece, and frequent: BPE merges it into a token ("5.")
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[0-9]\.|[0-9]|[^0-9]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.train_from_iterator(TEXTS + [f"{d}." for d in range(10)] * 50 + ["."],
                            trainers.BpeTrainer(vocab_size=200, special_tokens=["<pad>"], show_progress=False))
    found["merged_point"] = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>")
    return root, found


def _recipe(terms: dict, policy: str = "digits"):
    return recipe_from_dict({"model": {"config": {"model_type": "llama"}, "tokenizer": "unused"},
                             "data": {"train": "unused"},
                             "loss": {"objective": {"terms": terms}, "numeric_policy": policy}})


def test_del_and_ntil_against_four_tokenizers(tokenizers):
    from recipes.checks.objective_checks import tokenizer_problems

    _, tok = tokenizers
    recipe = _recipe({"del": {}, "ntil": {}, "smmd": {}})
    assert tokenizer_problems(recipe, tok["digits"]) == []
    assert tokenizer_problems(recipe, tok["no_point"]) == [
        "loss.objective.terms.del: term 'del' needs the decimal point's token id (NumericVocab.from_tokenizer finds"
        " '.'; or the term's decimal_point_id option); "
        f"{_vocab(tok['no_point'])!r} has none"]
    assert tokenizer_problems(recipe, tok["groups3"]) == [
        f"loss.objective.terms.{t}: {t.upper()} needs a tokenizer that writes each digit as a token of its own;"
        f" this one writes '12345.678' as ['123', '45', '.', '678']: use a digit-level tokenizer (Qwen2.5,"
        " SmolLM2, ...) or a term without this need" for t in ("del", "ntil")]
    merged = tokenizer_problems(recipe, tok["merged_point"])
    assert [m.split(": ", 1)[0] for m in merged] == ["loss.objective.terms.del"] * 2 + ["loss.objective.terms.ntil"]
    assert "'5.'" in merged[0] and "the decimal point as a token of its own" in merged[1]
    # DEL given the point's id as an option does not need the tokenizer's
    assert tokenizer_problems(_recipe({"del": {"decimal_point_id": 3}}), tok["no_point"]) == []
    # the policy's own refusal is said once, by objective_problems
    assert tokenizer_problems(_recipe({"del": {}}, policy="integers"), tok["groups3"]) == []


def _vocab(tokenizer):
    from numloss import NumericVocab

    return NumericVocab.from_tokenizer(tokenizer, policy="digits")


def test_a_users_term_is_judged_by_its_registered_needs(tokenizers):
    import numloss
    from recipes.checks.objective_checks import tokenizer_problems

    def first_digit(stats, vocab, denominator=None):
        return stats.numeric.logits.sum() * 0

    _, tok = tokenizers
    numloss.register_term("first_digit", first_digit, default_weight=1.0, needs=("digits",))
    try:
        recipe = _recipe({"first_digit": {}})
        assert tokenizer_problems(recipe, tok["digits"]) == []
        [problem] = tokenizer_problems(recipe, tok["groups3"])
        assert problem.startswith("loss.objective.terms.first_digit: FIRST_DIGIT needs a tokenizer that writes")
    finally:
        numloss.unregister_term("first_digit")


def test_train_refuses_del_on_a_tokenizer_that_is_not_digit_level_before_anything(tokenizers, tmp_path):
    from data_prep.sources.base import SourceConfig
    from recipes.experiments.tiny import build_plain_shards, tiny_llama_config

    root, tok = tokenizers
    build_plain_shards(SourceConfig(kind="arithmetic", options={"n": 16, "max_digits": 3}), root / "groups3",
                       tmp_path / "data", numeric_policy="digits")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"config": tiny_llama_config(len(tok["groups3"])), "tokenizer": str(root / "groups3"),
                  "dtype": "float32"},
        "data": {"train": str(tmp_path / "data")}, "loss": {"objective": {"terms": {"del": {}}}},
        "train": {"steps": 1, "micro_batch_size": 2, "out_dir": str(tmp_path / "out"), "progress": False}}))
    proc = subprocess.run([sys.executable, "-m", "recipes.train", str(recipe)], cwd=REPO,
                          env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "cannot run (1 error):\n  loss.objective.terms.del: DEL needs a tokenizer that writes each digit" \
        in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()  # preflight runs before the run directory and the engine


def test_validate_reports_what_the_terms_need_of_the_tokenizer(tokenizers, tmp_path):
    """recipes.validate loads the model's tokenizer when a term needs something of it, data built or not,
    and reports the same refusal recipes.train makes (exit 1: an error, not a layout)."""
    from recipes.experiments.tiny import tiny_llama_config

    root, tok = tokenizers
    for name, terms, expected in (("groups3", {"del": {}}, "loss.objective.terms.del: DEL needs a tokenizer that"
                                   " writes each digit"), ("digits", {"del": {}}, None)):
        recipe = tmp_path / f"{name}.yaml"
        recipe.write_text(yaml.safe_dump({
            "model": {"config": tiny_llama_config(len(tok[name])), "tokenizer": str(root / name), "dtype": "float32"},
            "data": {"train": str(tmp_path / "no-data")}, "loss": {"objective": {"terms": terms}},
            "train": {"steps": 1, "micro_batch_size": 2, "out_dir": str(tmp_path / "out"), "progress": False}}))
        proc = subprocess.run([sys.executable, "-m", "recipes.validate", str(recipe)], cwd=REPO,
                              env={**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1"},
                              capture_output=True, text=True, timeout=300)
        if expected is None:
            assert proc.returncode == 0, proc.stdout + proc.stderr
            assert "DEL needs" not in proc.stdout + proc.stderr
        else:
            assert proc.returncode == 1, proc.stdout + proc.stderr
            assert expected in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_a_policy_that_cannot_serve_del_is_refused_before_any_model():
    recipe = recipe_from_dict({
        "name": "del-test",
        "model": {"name_or_path": "unused", "tokenizer": "unused", "dtype": "float32"},
        "data": {"train": "unused"},
        "optim": {"lr": 1e-3, "warmup_steps": 1},
        "deepspeed": {"zero_stage": 2},
        "megatron": {"distributed_optimizer": False},
        "train": {"engine": "deepspeed", "steps": 1, "micro_batch_size": 2, "grad_accum": 4, "out_dir": "unused",
                  "export": False},
    }, ["loss.objective={terms: {del: {}}}"])
    recipe.loss.numeric_policy = "integers"
    assert preflight.objective_problems(recipe) == [
        "loss.objective.terms.del: DEL needs loss.numeric_policy digits, got 'integers'"]
    recipe.loss.numeric_policy, recipe.loss.space_variants = "digits", True
    assert preflight.objective_problems(recipe) == [
        "loss.objective.terms.del: DEL needs the ten digit tokens alone; loss.space_variants adds a second"
        " token per digit"]


def test_ntil_on_a_non_digits_policy_is_refused_by_both(demo_on_test_data):
    overrides = [*demo_on_test_data, "loss.numeric_policy=integers", "loss.objective={terms: {ntil: 0.3}}"]
    rep = validate_recipe(DEMO, overrides, offline=True, size=False)
    assert any(e.startswith("loss.objective.terms.ntil") for e in rep.errors)
    with pytest.raises(preflight.RecipeCheckError, match="NTIL needs loss.numeric_policy digits"):
        preflight.preflight(load_recipe(DEMO, overrides), world_size=2)
