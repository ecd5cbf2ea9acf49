"""The engine contract (recipes.engines): the registry, and `train.engine=<other>` on every shipped recipe.

Switching engines (docs/reliability.md, "Settings the engine ignores"): each shipped recipe, loaded with
the other engine, is either refused naming its keys (when it loads, or by the engine-settings check), or
adopted with one note per mapped setting and the mapped values the table says; the adopted recipe then
passes the layout checks on its own cluster.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from recipes.checks import model_checks
from recipes.checks.engine_settings import engine_setting_problems
from recipes.config import load_recipe
from recipes.engines import ENGINES, EngineContract, engine_contract, register

REPO = Path(__file__).resolve().parents[3]
CONFIGS = REPO / "recipes" / "configs"

# recipe -> what `train.engine=<the other engine>` gives: refused when it loads (the key), refused by the
# settings check (the keys, in order), or adopted: the values the recipe then holds (the table's mapping,
# written out here, not read from the code), how many notes say so, and the keys the layout and model
# checks then refuse (none unless given)
OUTCOMES = {
    "demo.yaml": ("adopted", {"megatron.distributed_optimizer": True, "megatron.recompute": None}, 0),
    # the chunked head's logits bound (1024 tokens, rows of unknown length): one row a micro-batch, the
    # same 64 rows a step (8 x 1 x DP 8 -> 1 x 8 x DP 8)
    "llama3-8b-gsm8k/ce.yaml": ("adopted", {"megatron.recompute": "full", "model.gradient_checkpointing": False,
                                            "loss.head": "logits", "megatron.tp_size": 1, "train.micro_batch_size": 1,
                                            "train.grad_accum": 8}, 3),
    "llama3-8b-gsm8k/smmd.yaml": ("adopted", {"megatron.recompute": "full", "model.gradient_checkpointing": False,
                                              "loss.head": "logits", "train.micro_batch_size": 1,
                                              "train.grad_accum": 8}, 3),
    "llama3-8b-gsm8k/megatron.yaml": ("adopted", {"deepspeed.zero_stage": 3, "deepspeed.tp_size": 1,
                                                  "model.gradient_checkpointing": False}, 0),
    # Ulysses' sp 4 becomes context parallelism 4 (the layout checks pass; CP is refused at start)
    "llama3.1-8b-reasoning-32k/deepspeed.yaml": ("adopted", {"megatron.cp_size": 4, "deepspeed.sp_size": 1,
                                                             "megatron.recompute": "full", "loss.head": "logits",
                                                             "train.micro_batch_size": 1, "train.grad_accum": 8}, 3),
    "llama3.1-8b-reasoning-32k/megatron.yaml": ("refused", ["megatron.pp_size", "megatron.sequence_parallel"]),
    "ministral3-3b-clock.yaml": ("load", "model.vision"),
    "qwen2.5-1.5b-gsm8k/ce.yaml": ("adopted", {"megatron.recompute": None, "loss.head": "logits"}, 0),
    "qwen2.5-1.5b-gsm8k/dist2.yaml": ("adopted", {"megatron.recompute": None}, 0),
    "qwen2.5-1.5b-gsm8k/gce.yaml": ("adopted", {"megatron.recompute": None}, 0),
    "qwen2.5-1.5b-gsm8k/ntil.yaml": ("adopted", {"megatron.recompute": None}, 0),
    "qwen2.5-1.5b-gsm8k/ntl.yaml": ("adopted", {"megatron.recompute": None}, 0),
    "qwen2.5-1.5b-gsm8k/smmd.yaml": ("adopted", {"megatron.recompute": None}, 0),
    "qwen2.5-vl-7b-chartqa.yaml": ("load", "model.vision"),
    "qwen2.5-vl-7b-clock.yaml": ("load", "model.vision"),
    "scale/llama3-70b-4x8.yaml": ("adopted", {"megatron.recompute": "full", "loss.head": "logits",
                                              "train.micro_batch_size": 1, "train.grad_accum": 2}, 3),
    "scale/llama3-70b-8x8.yaml": ("adopted", {"megatron.recompute": "full", "loss.head": "logits",
                                              "train.micro_batch_size": 1, "train.grad_accum": 1}, 2),
    "scale/llama3-70b-8x8-tp8.yaml": ("adopted", {"megatron.tp_size": 8, "deepspeed.tp_size": 1,
                                                  "megatron.recompute": "full", "loss.head": "logits"}, 2),
    "scale/llama3-70b-megatron-tp8pp4.yaml": ("refused", ["megatron.pp_size", "megatron.sequence_parallel"]),
    "scale/mixtral-8x22b-4x8.yaml": ("refused", ["megatron.pp_size", "megatron.ep_size"]),
    "scale/mixtral-8x22b-8x8.yaml": ("refused", ["megatron.pp_size", "megatron.ep_size", "megatron.sequence_parallel"]),
    "scale/qwen3-30b-a3b-4x8.yaml": ("refused", ["megatron.pp_size", "megatron.ep_size"]),
    "scale/qwen3-30b-a3b-8x8.yaml": ("refused", ["megatron.pp_size", "megatron.ep_size"]),
    "smollm2-demo.yaml": ("adopted", {"megatron.recompute": None}, 0),
    "smollm2-lora.yaml": ("load", "model.lora"),
    "smollm2-study.yaml": ("adopted", {"megatron.recompute": None}, 0),
    # adopted, then refused by the model checks: Megatron converts no SmolLM3
    "smollm3-3b-dm-math.yaml": ("adopted", {"loss.head": "logits", "train.micro_batch_size": 1,
                                            "train.grad_accum": 16}, 2, ["model"]),
    "study.yaml": ("adopted", {"megatron.recompute": None}, 0),
    "starter/cpu.yaml": ("adopted", {"megatron.distributed_optimizer": True, "megatron.recompute": None}, 0),
}


def _value(recipe, key: str):
    section, name = key.split(".", 1)
    return getattr(getattr(recipe, section), name)


def test_every_shipped_recipe_has_an_expected_outcome():
    shipped = sorted(str(p.relative_to(CONFIGS)) for p in CONFIGS.rglob("*.yaml"))
    assert shipped == sorted(OUTCOMES)


@pytest.mark.parametrize("name", sorted(OUTCOMES))
def test_switching_a_shipped_recipe_to_the_other_engine(name):
    path = CONFIGS / name
    own = load_recipe(path).train.engine
    other = next(engine for engine in ENGINES if engine != own)
    outcome = OUTCOMES[name]
    if outcome[0] == "load":
        with pytest.raises(ValueError, match=rf"{outcome[1]}\b"):
            load_recipe(path, [f"train.engine={other}"])
        return
    recipe = load_recipe(path, [f"train.engine={other}"])
    errors, notes = engine_setting_problems(recipe)
    if outcome[0] == "refused":
        assert [e.split(":")[0] for e in errors] == outcome[1], errors
        assert all(f"train.engine: {other}" in e for e in errors), errors
        return
    expected, note_count, refused_after = outcome[1], outcome[2], (outcome[3:] or [[]])[0]
    assert errors == [], errors
    assert len(notes) == note_count, notes
    for key, value in expected.items():
        assert _value(recipe, key) == value, (key, _value(recipe, key))
    # said once, each naming the key it came from and the key it set
    for note in notes:
        assert note.split(":")[0] in {"model.gradient_checkpointing", "loss.head", "deepspeed.tp_size",
                                      "deepspeed.zero_stage", "megatron.tp_size", "megatron.recompute",
                                      "deepspeed.sp_size", "megatron.cp_size"}, note
        assert " sets " in note
    assert engine_setting_problems(recipe) == ([], [])  # adopted: nothing is left to say
    # the adopted recipe's layout on its own cluster (the model's offline config: no network)
    cfg, _, _ = model_checks.model_config(recipe, offline=True)
    world = engine_contract(recipe).cluster_world(recipe)
    assert [e.split(":")[0] for e in model_checks.layout_problems(recipe, cfg, world)] == refused_after


def test_the_logits_bound_splits_micro_batches_by_the_rows_that_fit_a_chunk():
    recipe = load_recipe(CONFIGS / "llama3-8b-gsm8k/smmd.yaml", ["train.engine=megatron", "data.seq_len=256"])
    errors, notes = engine_setting_problems(recipe)
    assert errors == [] and (recipe.train.micro_batch_size, recipe.train.grad_accum) == (4, 2)  # 1024 // 256 rows
    assert recipe.train.micro_batch_size * recipe.train.grad_accum == 8  # the same rows per rank and step
    assert any("train.micro_batch_size: 4 (was 8)" in note for note in notes), notes


def test_validate_passes_a_shipped_deepspeed_recipe_switched_to_megatron(capsys):
    from recipes.validation import validate

    assert validate.main([str(CONFIGS / "llama3-8b-gsm8k/smmd.yaml"), "train.engine=megatron", "--offline"]) == 0
    out = capsys.readouterr().out
    assert "it sets megatron.recompute: full" in out and "Megatron TP 1 x PP 1 x DP 8" in out


def test_an_adopted_setting_the_recipe_also_sets_for_the_engine_is_used_as_set():
    recipe = load_recipe(CONFIGS / "llama3-8b-gsm8k/ce.yaml", ["train.engine=megatron", "megatron.recompute=selective"])
    errors, notes = engine_setting_problems(recipe)
    assert errors == [] and recipe.megatron.recompute == "selective" and not recipe.model.gradient_checkpointing
    assert any("megatron.recompute: selective, used as set" in note for note in notes), notes


def test_a_refusal_leaves_the_recipe_as_written():
    recipe = load_recipe(CONFIGS / "scale/llama3-70b-8x8-tp8.yaml", ["train.engine=megatron",
                                                                    "deepspeed.offload_optimizer=true"])
    errors, _ = engine_setting_problems(recipe)
    assert [e.split(":")[0] for e in errors] == ["deepspeed.offload_optimizer"]
    assert "the Megatron engine keeps the optimizer on the GPU" in errors[0]
    assert recipe.deepspeed.tp_size == 8 and recipe.megatron.tp_size == 1 and recipe.model.gradient_checkpointing


@pytest.mark.parametrize("overrides, key", [
    (["deepspeed.zero_stage=0"], "megatron.distributed_optimizer"),  # no sharding: a replicated optimizer
    (["deepspeed.zero_stage=2"], "megatron.distributed_optimizer"),
])
def test_zero_sharding_maps_onto_the_distributed_optimizer(overrides, key):
    recipe = load_recipe(CONFIGS / "demo.yaml", ["train.engine=megatron", *overrides])
    errors, notes = engine_setting_problems(recipe)
    assert errors == [] and len(notes) == 1
    assert recipe.megatron.distributed_optimizer is (overrides != ["deepspeed.zero_stage=0"])
    assert recipe.deepspeed.zero_stage == 3  # the DeepSpeed key back at its default: recipe.yaml says what runs


def test_megatron_settings_map_back_onto_deepspeed():
    recipe = load_recipe(CONFIGS / "llama3-8b-gsm8k/megatron.yaml", [
        "train.engine=deepspeed", "megatron.tp_size=2", "megatron.recompute=full", "megatron.distributed_optimizer=false",
        "megatron.load_converted=/somewhere"])
    errors, notes = engine_setting_problems(recipe)
    assert errors == [], errors
    assert (recipe.deepspeed.tp_size, recipe.model.gradient_checkpointing, recipe.deepspeed.zero_stage) == (2, True, 0)
    assert (recipe.megatron.tp_size, recipe.megatron.recompute, recipe.megatron.load_converted) == (1, None, None)
    assert len(notes) == 4


@pytest.mark.parametrize("override", ["deepspeed.overrides={zero_optimization: {overlap_comm: false}}",
                                      "deepspeed.offload_params=true", "deepspeed.reduce_dtype=bf16"])
def test_deepspeed_intents_megatron_cannot_keep_are_refused_naming_the_key(override):
    recipe = load_recipe(CONFIGS / "demo.yaml", ["train.engine=megatron", override])
    errors, _ = engine_setting_problems(recipe)
    assert [e.split(":")[0] for e in errors] == [override.split("=")[0]]


@pytest.mark.parametrize("override", ["megatron.virtual_pp_size=2", "megatron.overlap_grad_reduce=false",
                                      "megatron.transformer_impl=local", "megatron.moe_token_dispatcher=alltoall"])
def test_megatron_intents_deepspeed_cannot_keep_are_refused_naming_the_key(override):
    recipe = load_recipe(CONFIGS / "demo.yaml", [override])
    errors, _ = engine_setting_problems(recipe)
    assert [e.split(":")[0] for e in errors] == [override.split("=")[0]]


def test_the_registry_names_train_engine_and_the_known_engines():
    assert list(ENGINES) == ["deepspeed", "megatron"]
    assert all(isinstance(contract, EngineContract) for contract in ENGINES.values())
    assert engine_contract("megatron") is ENGINES["megatron"]
    with pytest.raises(ValueError, match=r"train.engine: 'fsdp' is not one of \['deepspeed', 'megatron'\]"):
        engine_contract("fsdp")
    with pytest.raises(ValueError, match="engine 'megatron' is registered already"):
        register(type(ENGINES["megatron"]))
    assert list(ENGINES) == ["deepspeed", "megatron"]
    with pytest.raises(ValueError, match=r"train.engine: 'fsdp' is not one of \['deepspeed', 'megatron'\]"):
        load_recipe(CONFIGS / "demo.yaml", ["train.engine=fsdp"])


def test_each_engine_recognises_only_its_own_checkpoints():
    recipe = load_recipe(CONFIGS / "demo.yaml")
    layouts = {name: contract.checkpoint_layout(recipe, 4) for name, contract in ENGINES.items()}
    for name, contract in ENGINES.items():
        assert [other for other, layout in layouts.items() if contract.saved_by(layout)] == [name]


def test_each_engine_declares_the_resume_rules_of_its_own_section(monkeypatch):
    """What a resume may change in an engine's section is that engine's contract's word (`resume_rules`),
    in the resume policy's kinds; the policy adds no row of its own there, and refuses a contract's rule
    for a key outside its section. The kinds below are docs/reliability.md's table, written out."""
    from recipes.reliability import resume_policy as policy

    for contract in ENGINES.values():
        rules = contract.resume_rules
        assert rules and all(key.split(".")[0] == contract.section for key in rules)
        assert all(kind in ("training", "run", "refused") and why for kind, why in rules.values())
        assert {k: v for k, v in policy.POLICY.items() if k.split(".")[0] == contract.section} == rules
    refused = {"deepspeed.zero_stage", "deepspeed.tp_size", "deepspeed.offload_optimizer", "deepspeed.offload_params",
               "megatron.distributed_optimizer"}
    for key in ("deepspeed.reduce_dtype", "deepspeed.overrides.zero_optimization.overlap_comm", "megatron.tp_size",
                "megatron.pp_size", "megatron.ep_size", "megatron.recompute", *refused):
        assert policy.classify(key)[0] == ("refused" if key in refused else "run"), key
    monkeypatch.setattr(ENGINES["megatron"], "resume_rules", {"train.steps": ("run", "a loop key")})
    with pytest.raises(ValueError, match="megatron's resume_rules: train.steps is not a key of its own section"):
        policy._engine_rules()
