"""Qwen3 dense on the Megatron engine: per-head q / k RMSNorm before RoPE, head_dim 32 where hidden / heads
is 16, no biases, tied or untied embeddings, every RoPE kind a config can carry.

Two tiny random Qwen3 checkpoints (`helpers.QWEN3`): untied with YaRN (factor 4 over 16 original positions,
so the ramp falls inside the head and the attention factor scales the scores), and tied with default RoPE.

- in one process: HF -> Megatron -> HF bit for bit at TP 1, TP 2, PP 2, TP 2 x PP 2, under both specs'
  names (the q / k norms keep theirs under TE); every RoPE kind's frequencies and score scale equal
  transformers' own rotary embedding's (bit for bit), dynamic / longrope / partial rotary / sliding
  layers refused; the planner's parameter count equals the HF model's; a TP that does not divide the KV
  heads is refused by `recipes.validate` (exit 2: a layout the model cannot take) and by the checks `recipes.train`
  runs first (exit 2);
- on 2 gloo processes: logits equal HF's (fp32, 1e-5) at TP 1 (DP 2), TP 2, TP 2 + SP and PP 2 for
  both checkpoints, and a training step's loss and every gradient (the q / k norms' summed over the TP
  ranks' heads) equal HF's at TP 2, TP 2 + SP and PP 2;
- on 2 gloo processes: the DeepSpeed engine (ZeRO-2, DP 2) and the Megatron engine at DP 2, TP 2, TP 2 +
  SP and PP 2 log the same step-1 loss, CE, terms and gradient norm (1e-5 relative) for the same recipe;
  the TP 2 engine's export after that step loads in transformers with the Megatron model's logits (1e-5).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from tests.recipes.engines.megatron.helpers import QWEN3, VOCAB, recipe_for, run_ranks, save_tiny

if importlib.util.find_spec("megatron.core") is None:
    raise ImportError("tests/recipes/engines/megatron needs megatron-core (pip install -e '.[megatron]')")

TIED = {"tie_word_embeddings": True, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3")
    return {"untied": save_tiny("qwen3", root / "untied"), "tied": save_tiny("qwen3", root / "tied", **TIED)}


def _config(**changes):
    from transformers import AutoConfig

    return AutoConfig.for_model("qwen3", **{**QWEN3, **changes})


# ---- conversion, RoPE, refusals, planner (one process) -----------------------------------------------


@pytest.mark.parametrize("kind", ["untied", "tied"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_round_trip_bit_exact_under_both_specs(checkpoints, kind, tp, pp):
    from transformers import AutoConfig

    from recipes.engines.megatron.runtime.convert import (
        SafetensorsReader,
        global_layer_names,
        hf_to_megatron,
        layer_range,
        megatron_to_hf,
        te_name,
        transformer_config_from_hf,
    )

    path = checkpoints[kind]
    hf_config, reader = AutoConfig.from_pretrained(str(path)), SafetensorsReader(path)
    hf = {k: reader(k) for k in reader}
    assert "model.layers.0.self_attn.q_norm.weight" in hf and ("lm_head.weight" in hf) == (kind == "untied")
    config = transformer_config_from_hf(hf_config, tp_size=tp, pp_size=pp)
    assert config.qk_layernorm and not config.add_qkv_bias and config.kv_channels == 32
    for te in (False, True):
        gathered: dict[str, list] = {}
        for pp_rank in range(pp):
            offset = layer_range(config, pp_rank).start
            for tp_rank in range(tp):
                where = {"tp_rank": tp_rank, "tp_size": tp, "pp_rank": pp_rank, "pp_size": pp}
                state = hf_to_megatron(reader, config, hf_config, te_names=te, **where)
                layer = "decoder.layers.0.self_attention."
                # 2/tp groups x (2 q heads + k + v) x head dim 32; o_proj's columns of this rank's heads
                assert state[layer + "linear_qkv.weight"].shape == (2 // tp * 4 * 32, 64)
                assert state[layer + "linear_proj.weight"].shape == (64, 4 * 32 // tp)
                assert torch.equal(state[layer + "q_layernorm.weight"],
                                   hf[f"model.layers.{offset}.self_attn.q_norm.weight"])
                assert torch.equal(state[layer + "k_layernorm.weight"],
                                   hf[f"model.layers.{offset}.self_attn.k_norm.weight"])
                if te:
                    assert te_name(layer + "q_layernorm.weight") == layer + "q_layernorm.weight"
                    local = hf_to_megatron(reader, config, hf_config, **where)
                    assert {te_name(k) for k in local} == set(state)
                for name, t in global_layer_names(state, offset).items():
                    gathered.setdefault(name, []).append(t)
        back = megatron_to_hf(gathered, config, hf_config)
        assert sorted(back) == sorted(hf), (te, set(back) ^ set(hf))
        for name, t in hf.items():
            assert torch.equal(back[name], t), (te, name)


ROPE_KINDS = {
    "default": {"rope_type": "default", "rope_theta": 1e6},
    "linear": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "yarn": QWEN3["rope_parameters"],
    # Qwen3's model card's long-context setting (factor 4 over 32,768 positions)
    "yarn-card": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768},
    "yarn-untruncated": {**QWEN3["rope_parameters"], "truncate": False, "beta_fast": 16, "beta_slow": 2},
    "yarn-mscale": {**QWEN3["rope_parameters"], "mscale": 0.9, "mscale_all_dim": 0.7},
    "yarn-attention-factor": {**QWEN3["rope_parameters"], "attention_factor": 1.5},
}


@pytest.mark.parametrize("name", sorted(ROPE_KINDS))
def test_every_reproduced_rope_kind_is_transformers_own(name):
    """Frequencies bit for bit and the scores' scale: HF multiplies q and k by `attention_scaling`, the
    engine the scores by its square (the softmax scale)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    from recipes.engines.megatron.runtime.convert import rope_inv_freq, transformer_config_from_hf

    hf_config = _config(rope_parameters=dict(ROPE_KINDS[name]), max_position_embeddings=64)
    rotary = Qwen3RotaryEmbedding(hf_config)
    assert torch.equal(rope_inv_freq(hf_config, 32), rotary.inv_freq)
    scale = transformer_config_from_hf(hf_config).softmax_scale
    if rotary.attention_scaling == 1.0:
        assert scale is None  # megatron's own 1 / sqrt(d), as HF's head_dim ** -0.5
    else:
        assert name.startswith("yarn") and scale == pytest.approx(rotary.attention_scaling ** 2 / math.sqrt(32),
                                                                  rel=1e-12)


@pytest.mark.parametrize("changes, match", [
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "dynamic.*each batch"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 16,
                          "long_factor": [2.0] * 16, "original_max_position_embeddings": 16}}, "longrope"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, "sliding_attention"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_what_cannot_be_reproduced_is_refused(changes, match):
    from recipes.engines.megatron.runtime.convert import check_supported, transformer_config_from_hf

    hf_config = _config(**changes)
    with pytest.raises(NotImplementedError, match=match):
        check_supported(hf_config)
    with pytest.raises(NotImplementedError, match=match):
        transformer_config_from_hf(hf_config)


@pytest.mark.parametrize("tied", [False, True])
def test_planner_counts_the_hf_models_parameters(tied):
    """The Megatron planner's parameters at TP 1 x PP 1 are the HF model's (its own count, from an
    empty-weight model) plus the padding rows of the vocabulary: the q / k norms included."""
    from recipes.planning.backbones import count_parameters
    from recipes.engines.megatron.pure.costs import padded_vocab, stage_params
    from recipes.planning.placement import Placement
    from recipes.planning.shape import Shape

    hf_config = _config(tie_word_embeddings=tied)
    shape = Shape.of(hf_config)
    assert shape.head_dim == 32
    total, _ = count_parameters(hf_config)
    padding = (padded_vocab(VOCAB, 1) - VOCAB) * 64 * (1 if tied else 2)
    assert stage_params(shape, Placement.of(1, 1, 1, 1, False), 0, tied, qk_norm=True) == total + padding
    two = Placement.of(2, 2, 1, 1, False)
    held = sum(stage_params(shape, two, r, tied, qk_norm=True) for r in range(2))
    replicated = 2 * (2 * 64 + 2 * 32) + 64  # per layer: both norms, both q / k norms; the final norm
    copy = padded_vocab(VOCAB, 2) * 64 if tied else 0  # the last stage's copy of the tied embedding
    assert 2 * held - replicated == total + (padded_vocab(VOCAB, 2) - VOCAB) * 64 * (1 if tied else 2) + copy


def test_a_tp_that_does_not_divide_the_kv_heads_is_refused(tmp_path):
    import yaml

    from recipes.checks import preflight
    from recipes.config import load_recipe
    from recipes.validation import validate as V

    path = tmp_path / "qwen3.yaml"
    path.write_text(yaml.safe_dump({
        "name": "qwen3", "model": {"config": {"model_type": "qwen3", **QWEN3}, "tokenizer": "unused"},
        "data": {"train": "unused"}, "train": {"engine": "megatron", "micro_batch_size": 1, "grad_accum": 1},
        "megatron": {"tp_size": 2}, "cluster": {"nodes": 1, "gpus_per_node": 4}}))
    assert V.validate_recipe(path, [], offline=True).ok
    bad = ["megatron.tp_size=4"]  # 4 attention heads divide by 4, the 2 KV heads do not
    rep = V.validate_recipe(path, bad, offline=True)
    refusal = "megatron.tp_size: 4 does not divide the model's 2 KV heads"
    assert any(e.startswith(refusal) for e in rep.errors), rep.errors
    assert V.main([str(path), *bad, "--offline"]) == 2  # a layout the model cannot take (issue 39)
    with pytest.raises(preflight.RecipeCheckError, match="KV heads"):
        preflight.preflight(load_recipe(path, bad), world_size=4)


# ---- logits and gradients against HF (2 processes) ----------------------------------------------------


def _against_hf(rank, world, untied, tied):
    from megatron.core import parallel_state

    from tests.recipes.engines.megatron.runtime.test_model import _batch, _check_logits, _hf, _train_step

    ids, _ = _batch()
    for name, path in (("untied", untied), ("tied", tied)):
        hf = _hf(path)
        with torch.no_grad():
            reference = hf(ids).logits
        for layout in ({"tp": 1}, {"tp": 2}, {"tp": 2, "sp": True}, {"pp": 2}):
            _check_logits(recipe_for(path, **layout), reference, f"rank {rank} {name} {layout}")
        for layout in ({"tp": 2}, {"tp": 2, "sp": True}, {"pp": 2}):
            _train_step(recipe_for(path, **layout), hf)
            parallel_state.destroy_model_parallel()


def test_logits_and_gradients_equal_hf(checkpoints):
    run_ranks(2, _against_hf, checkpoints["untied"], checkpoints["tied"], timeout=300)


# ---- the two engines, and the export (2 processes) -----------------------------------------------------


def _engines(rank, world, assets, out):
    import torch.distributed as dist

    from megatron.core import parallel_state

    from recipes.engines.deepspeed.runtime.engine import DeepSpeedEngine
    from recipes.engines.megatron.runtime.engine import MegatronEngine
    from recipes.reliability.checkpoints import CheckpointDirs
    from tests.recipes.engines.megatron import engine_helpers as H
    from tests.recipes.engines.megatron.runtime.test_model import _batch, _gather_vocab

    runtime, out = H.gloo_rank_runtime(rank, world), Path(out)
    recipe = H.make_recipe(assets, micro=2, accum=2, steps=1)
    recipe.train.engine, recipe.deepspeed.zero_stage = "deepspeed", 2
    engine = DeepSpeedEngine(recipe, runtime, CheckpointDirs(out / "ds", 1, runtime))
    rows = {"deepspeed": H.run_steps(engine, assets, 1, 1)[0]}
    engine.close()
    for name, layout in (("dp2", {"micro": 2, "accum": 2}), ("tp2", {"tp": 2, "micro": 8, "accum": 1}),
                         ("tp2_sp", {"tp": 2, "sp": True, "micro": 4, "accum": 2}),
                         ("pp2", {"pp": 2, "micro": 2, "accum": 4})):
        engine = MegatronEngine(H.make_recipe(assets, steps=1, **layout), runtime)
        rows[name] = H.run_steps(engine, assets, 1, 1)[0]
        if name == "tp2":  # the trained model's logits, then its export
            ids, _ = _batch()
            model = engine.model[0].module
            model.eval()
            with torch.no_grad():
                logits = _gather_vocab(model(ids, torch.arange(ids.shape[1])[None].expand_as(ids), None))
            engine.export(out / "export")
            if rank == 0:
                torch.save(logits[..., :VOCAB].clone(), out / "megatron_logits.pt")
        engine.close()
        assert not parallel_state.model_parallel_is_initialized()
    if rank == 0:
        H.write(out / "rows.json", rows)
    dist.barrier()


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory):
    from tests.recipes.engines.megatron import engine_helpers as H

    root = tmp_path_factory.mktemp("qwen3_engines")
    tokenizer = H.digits_tokenizer(root)
    model = save_tiny("qwen3", root / "model", pad_token_id=tokenizer.pad_token_id)
    assets = {"tokenizer": str(root / "tokenizer"), "model": str(model)}
    out = root / "out"
    out.mkdir()
    run_ranks(2, _engines, assets, str(out), timeout=400)
    return out, H.read(out / "rows.json")


def test_step_one_equals_the_deepspeed_engine_at_every_layout(engine_runs):
    _, rows = engine_runs
    reference = rows.pop("deepspeed")
    assert reference["grad_norm"] > 0 and all(reference[k] > 1e-3 for k in reference if k.startswith("term/"))
    assert {"loss", "ce", "numeric_positions"} <= set(reference)
    for name, row in rows.items():
        for key, value in reference.items():
            if key in ("tokens_run", "lr"):
                continue
            assert row[key] == pytest.approx(value, rel=1e-5, abs=1e-12), f"{name} {key}: {row[key]} != {value}"


def test_the_export_loads_in_transformers_with_the_megatron_logits(engine_runs):
    from transformers import AutoModelForCausalLM

    from tests.recipes.engines.megatron.runtime.test_model import _batch

    out, _ = engine_runs
    model = AutoModelForCausalLM.from_pretrained(out / "export", dtype=torch.float32).eval()
    assert model.config.model_type == "qwen3" and model.config.head_dim == 32
    before = AutoModelForCausalLM.from_pretrained(out.parent / "model")
    for norm in ("q_norm", "k_norm"):  # the step reached the q / k norms
        assert not torch.equal(getattr(model.model.layers[0].self_attn, norm).weight,
                               getattr(before.model.layers[0].self_attn, norm).weight)
    ids, _ = _batch()
    with torch.no_grad():
        logits = model(ids).logits
    torch.testing.assert_close(logits, torch.load(out / "megatron_logits.pt"), rtol=1e-5, atol=1e-5)
