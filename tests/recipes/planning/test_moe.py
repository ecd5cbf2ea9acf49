"""The planner on mixture-of-experts models (recipes/planning/moe.py, megatron_costs with EP, recommend,
validate): parameter counts against tiny HF models and the published totals, memory and all-to-all bytes
against hand arithmetic, the recommended layouts of the scale recipes, and the layouts refused (exit 2)."""

from pathlib import Path

import pytest
import torch
import yaml

from recipes.engines.megatron.pure import plan as megatron_plan
from recipes.engines.megatron.pure.layout import shape_problems
from recipes.engines.megatron.pure import costs as megatron_costs
from recipes.planning import placement
from recipes.planning import moe as moe_math
from recipes.planning.shape import Shape
from recipes.planning.moe import MoEShape, parameter_counts

SCALE = Path(__file__).resolve().parents[3] / "recipes" / "configs" / "scale"

TINY = {
    "qwen3_moe": dict(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=2,
                      tie_word_embeddings=False),
    "qwen3_moe_mixed": dict(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=6, num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[3],
                            tie_word_embeddings=True),
    "mixtral": dict(vocab_size=97, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                      shared_expert_intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, num_experts=6, num_experts_per_tok=2),
}

# the public config.json values (stated in recipes/planning/backbones.py's offline table too)
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8, tie_word_embeddings=False)
MIXTRAL_8X22B = dict(vocab_size=32768, hidden_size=6144, intermediate_size=16384, num_hidden_layers=56,
                     num_attention_heads=48, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                     tie_word_embeddings=False)


def _config(kind, values):
    from transformers import AutoConfig

    return AutoConfig.for_model(kind.removesuffix("_mixed"), **values)


@pytest.mark.parametrize("kind", sorted(TINY))
def test_total_and_active_parameters_equal_the_hf_model(kind):
    """Total: the numel sum of an HF model built from the config; active: its parameters outside the routed
    experts plus k/E of the experts' fused tensors (each token runs k of the E experts)."""
    from transformers import AutoModelForCausalLM

    cfg = _config(kind, TINY[kind])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    moe = MoEShape.of(cfg)
    counts = parameter_counts(cfg)
    assert counts.total == total
    assert counts.experts == routed
    assert counts.active == total - routed + routed * moe.top_k // moe.experts
    assert counts.active < counts.total


@pytest.mark.parametrize("kind, extra", [("qwen2_moe", {}), ("qwen2_moe", {"qkv_bias": False}), ("qwen3_moe", {}),
                                         ("qwen3_moe_mixed", {}), ("mixtral", {}), ("qwen3_moe", {"attention_bias": True})])
def test_the_megatron_planners_parameters_equal_the_hf_model(kind, extra):
    """The Megatron planner's parameters at TP = PP = EP = 1 (stage_params, with the q / k / v biases, q / k
    norms and tied embeddings model_flags reads from the config, as validate and recommend do) and
    parameter_counts: the numel sum of the HF model built from the config (vocabulary 128: no Megatron
    padding). qwen2_moe has q / k / v biases unless qkv_bias is false; qwen3_moe only with attention_bias
    (which the engine refuses: Megatron's stage parameters are not compared there), mixtral none."""
    from transformers import AutoModelForCausalLM

    cfg = _config(kind, {**TINY[kind], "vocab_size": 128, **extra})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    total = sum(p.numel() for p in model.parameters())
    biased = {n.rsplit(".", 2)[-2] for n, _ in model.named_parameters() if n.endswith("_proj.bias")}
    tied, qkv_bias, qk_norm = megatron_plan.model_flags(cfg)
    assert qkv_bias == bool(biased) == (kind == "qwen2_moe" and extra.get("qkv_bias", True) or "attention_bias" in extra)
    assert moe_math.output_bias(cfg) == ("o_proj" in biased)
    assert parameter_counts(cfg).total == total
    if "attention_bias" not in extra:
        shape, moe = Shape.of(cfg), MoEShape.of(cfg)
        assert megatron_costs.stage_params(shape, placement.Placement.of(1, 1, 1), 0, tied, qkv_bias, qk_norm, moe) == total


def test_qkv_bias_of_configs_without_the_key():
    """Qwen1.5-MoE's and Qwen2-MoE's config.json have no qkv_bias key (transformers 4 hard-coded the bias):
    biased; qwen2 always; qwen3_moe and mixtral not, unless attention_bias."""
    from types import SimpleNamespace as NS

    assert moe_math.qkv_bias(NS(model_type="qwen2_moe")) and moe_math.qkv_bias(NS(model_type="qwen2"))
    assert not moe_math.qkv_bias(NS(model_type="qwen2_moe", qkv_bias=False))
    assert not moe_math.qkv_bias(NS(model_type="qwen2_moe", qkv_bias=False, attention_bias=True))
    assert not moe_math.qkv_bias(NS(model_type="qwen3_moe")) and not moe_math.qkv_bias(NS(model_type="mixtral"))
    assert moe_math.qkv_bias(NS(model_type="qwen3_moe", attention_bias=True))
    assert moe_math.qkv_bias(NS(text_config=NS(model_type="qwen2_moe")))


def test_published_totals_are_reproduced_within_one_percent():
    q = parameter_counts(_config("qwen3_moe", QWEN3_30B_A3B))
    assert q.total == pytest.approx(30.5e9, rel=0.01) and q.active == pytest.approx(3.3e9, rel=0.02)
    x = parameter_counts(_config("mixtral", MIXTRAL_8X22B))
    assert x.total == pytest.approx(141e9, rel=0.01) and x.active == pytest.approx(39e9, rel=0.01)
    # the MLP width the dense arithmetic (FLOPs, SwiGLU activations) sees: k x the experts' width
    assert Shape.of(_config("qwen3_moe", QWEN3_30B_A3B)).intermediate == 8 * 768
    assert Shape.of(_config("mixtral", MIXTRAL_8X22B)).intermediate == 2 * 16384


def test_a_dense_model_has_no_moe_shape_and_active_equals_total():
    cfg = _config("qwen3", dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    assert MoEShape.of(cfg) is None
    c = parameter_counts(cfg)
    assert c.total == c.active and c.experts == 0


def _tiny_plan(ep, dp=8, recompute=None):
    cfg = _config("mixtral", dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                  num_attention_heads=8, num_key_value_heads=4, num_local_experts=8,
                                  num_experts_per_tok=2))
    shape, moe = Shape.of(cfg), MoEShape.of(cfg)
    lay = placement.Placement.of(1, 1, dp, gpus_per_node=8, ep=ep)
    return shape, moe, megatron_costs.estimate(shape, lay, micro_batch_size=2, grad_accum=1, tied=False, seq=128, moe=moe,
                              recompute=recompute, timed=False)


def test_expert_states_shrink_with_ep_by_hand():
    """Expert parameters per GPU: L x (E / ep) x 3 h I; their states (2 + 4 + 12 / (D / ep)) bytes each;
    the dense parameters' states do not change with ep."""
    h, i, layers, experts = 256, 512, 4, 8
    for ep in (1, 2, 4, 8):
        _, _, pl = _tiny_plan(ep)
        st = pl.stages[0]
        expert_params = layers * experts / ep * 3 * h * i
        assert st.expert_params == expert_params
        assert st.memory["expert states"] == pytest.approx(expert_params * (6 + 12 / (8 / ep)))
    dense = {ep: _tiny_plan(ep)[2].stages[0].memory["model states"] for ep in (1, 8)}
    assert dense[1] == dense[8]
    # ep 1 -> 8 on 8 DP ranks: 8x fewer expert weights and grads, the same optimizer share (D_e = 1)
    one, eight = _tiny_plan(1)[2].stages[0], _tiny_plan(8)[2].stages[0]
    assert one.memory["expert states"] - eight.memory["expert states"] == pytest.approx(
        layers * experts * 3 * h * i * (6 + 12 / 8) - layers * 3 * h * i * 18)
    # the planner's stage parameters at tp = pp = ep = 1: the HF count
    cfg = _config("mixtral", dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                  num_attention_heads=8, num_key_value_heads=4, num_local_experts=8,
                                  num_experts_per_tok=2))
    assert one.params == parameter_counts(cfg).total  # vocabulary 1024: no Megatron padding


def test_all_to_all_bytes_by_hand_inside_and_across_nodes():
    """4 all-to-alls per MoE layer per micro-batch of T k h e (ep - 1)/ep bytes each; of them (ep - g)/(ep - 1)
    cross the network when the group has g ranks on each node."""
    T, k, h, e = 256, 2, 256, 2
    assert moe_math.all_to_all_bytes(T, k, h, e, 4) == T * k * h * e * 3 / 4
    shape, moe, pl = _tiny_plan(4)
    st = pl.stages[0]
    assert st.ep_inter == 0 and st.ep_intra == pytest.approx(4 * 4 * T * k * h * e * 3 / 4)  # 4 layers x 4
    # EP 8 over 2 nodes of 4 GPUs: 4 of the 7 peers are on the other node
    lay = placement.Placement.of(1, 1, 8, gpus_per_node=4, ep=8)
    plan = megatron_costs.estimate(shape, lay, micro_batch_size=2, grad_accum=1, tied=False, seq=128, moe=moe, timed=False)
    sent = 4 * 4 * T * k * h * e * 7 / 8
    assert plan.stages[0].ep_inter == pytest.approx(sent * 4 / 7)
    assert plan.stages[0].ep_intra == pytest.approx(sent * 3 / 7)
    # full recompute runs the forward's two again
    assert _tiny_plan(4, recompute="full")[2].stages[0].ep_intra == pytest.approx(st.ep_intra * 6 / 4)


def test_layout_problems_name_ep_and_tp():
    cfg = _config("qwen3_moe", TINY["qwen3_moe"])
    shape, moe = Shape.of(cfg), MoEShape.of(cfg)
    problems = shape_problems(shape, placement.Placement.of(1, 1, 8, ep=4).dims, 1, moe)
    assert problems == ["megatron.ep_size: 4 does not divide the model's 6 experts"]
    problems = shape_problems(shape, placement.Placement.of(1, 1, 4, ep=3).dims, 1, moe)
    assert problems and problems[0].startswith("megatron.ep_size: 3 does not divide the data-parallel size 4")
    assert any("megatron.tp_size: 16" in p and "experts' intermediate size" in p
               for p in shape_problems(shape, placement.Placement.of(16, 1, 1, gpus_per_node=16).dims, 1, moe))
    dense = _config("qwen3", dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    assert shape_problems(Shape.of(dense), placement.Placement.of(1, 1, 2, ep=2).dims, 1, None) == [
        "megatron.ep_size: 2 > 1, but the model has no experts (a dense MLP)"]


@pytest.mark.parametrize("name, gpus", [("qwen3-30b-a3b-4x8", 32), ("qwen3-30b-a3b-8x8", 64),
                                        ("mixtral-8x22b-8x8", 64), ("mixtral-8x22b-4x8", 32)])
def test_scale_recipes_take_the_recommended_layout_with_ep_inside_a_node(name, gpus):
    from recipes.validation import validate

    rep = validate.validate_recipe(SCALE / f"{name}.yaml", offline=True, seq_len=1024)
    assert rep.ok, rep.render()
    rec = rep.numbers["recommendation"]
    assert rec["engine"] == "megatron"
    settings = dict(s.split("=", 1) for s in rec["settings"])
    tp, ep = int(settings["megatron.tp_size"]), int(settings["megatron.ep_size"])
    assert ep > 1 and tp * ep <= 8  # the EP group (ep DP ranks tp apart) inside one 8-GPU node
    assert rep.numbers["gpu_total_bytes"] <= rep.numbers["gpu_usable_bytes"]
    assert rep.numbers["ep_inter_node_bytes"] == 0 and rep.numbers["ep_intra_node_bytes"] > 0
    # the recipe is the recommendation (its step time is the recommended one)
    assert rep.numbers["step_time_s"] == pytest.approx(rec["step_time_s"])
    assert rep.numbers["active_params"] < rep.numbers["total_params"] == rep.numbers["params"]


def test_mixtral_8x22b_does_not_fit_4x8_h100():
    """141B parameters x 18 bytes (bf16 weights, fp32 main grads, fp32 Adam) / 32 GPUs = 79 GB > 71.2 GiB."""
    from recipes.validation import validate

    rep = validate.validate_recipe(SCALE / "mixtral-8x22b-4x8.yaml", ["cluster.gpu=H100", "cluster.gpu_mem_gb=80"],
                            offline=True, seq_len=1024)
    assert any(e.startswith("memory: stage") for e in rep.errors), rep.errors
    assert 141e9 * 18 / 32 > rep.numbers["gpu_usable_bytes"]


def _tiny_recipe(tmp_path, kind, ep=2, tp=1):
    path = tmp_path / f"{kind}.yaml"
    path.write_text(yaml.safe_dump({
        "name": kind, "model": {"config": {"model_type": kind, **TINY[kind]}, "tokenizer": "unused"},
        "data": {"train": "unused"}, "train": {"engine": "megatron", "micro_batch_size": 1, "grad_accum": 1},
        "megatron": {"tp_size": tp, "ep_size": ep, "sequence_parallel": tp > 1},
        "cluster": {"nodes": 1, "gpus_per_node": 8}}))
    return path


@pytest.mark.parametrize("kind, bad, refusal", [
    ("qwen3_moe", ["megatron.ep_size=4"], "megatron.ep_size: 4 does not divide the model's 6 experts"),
    ("mixtral", ["megatron.ep_size=1", "megatron.tp_size=4"], "megatron.tp_size: 4 does not divide the model's 2 KV heads"),
    ("qwen3_moe", ["megatron.tp_size=4", "megatron.ep_size=1"], "megatron.tp_size: 4 does not divide the model's 2 KV heads"),
])
def test_validate_refuses_layouts_the_model_cannot_take_with_exit_2(tmp_path, kind, bad, refusal, capsys):
    from recipes.checks import preflight
    from recipes.config import load_recipe
    from recipes.validation import validate

    path = _tiny_recipe(tmp_path, kind)
    assert validate.validate_recipe(path, [], offline=True).ok
    assert validate.main([str(path), "--offline"]) == 0
    rep = validate.validate_recipe(path, bad, offline=True)
    assert any(e.startswith(refusal) for e in rep.errors), rep.errors
    assert validate.main([str(path), *bad, "--offline"]) == 2
    assert refusal in capsys.readouterr().out
    with pytest.raises(preflight.RecipeCheckError, match="megatron.(ep|tp)_size"):
        preflight.preflight(load_recipe(path, bad), world_size=8)


def test_ep_not_dividing_the_data_parallel_size_is_refused(tmp_path):
    from recipes.validation import validate

    path = _tiny_recipe(tmp_path, "mixtral")  # 8 GPUs, TP 2 -> DP 4: EP 4 divides, EP 8 does not (nor 8 > 4 experts)
    assert validate.validate_recipe(path, ["megatron.tp_size=2", "megatron.sequence_parallel=true", "megatron.ep_size=4"],
                             offline=True).ok
    rep = validate.validate_recipe(path, ["megatron.tp_size=4", "megatron.sequence_parallel=true"], offline=True)
    assert any(e.startswith("megatron.tp_size: 4") for e in rep.errors)
    rep = validate.validate_recipe(path, ["cluster.gpus_per_node=6"], offline=True)  # DP 6, EP 2 divides; EP 4 does not
    assert rep.ok, rep.errors
    rep = validate.validate_recipe(path, ["cluster.gpus_per_node=6", "megatron.ep_size=4"], offline=True)
    assert any(e.startswith("megatron.ep_size: 4 does not divide the data-parallel size 6") for e in rep.errors)
    assert validate.main([str(path), "cluster.gpus_per_node=6", "megatron.ep_size=4", "--offline"]) == 2


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_autotp_on_an_moe_model_is_refused_before_any_model_is_built(tmp_path, kind, capsys):
    from recipes.checks import preflight
    from recipes.config import load_recipe
    from recipes.validation import validate

    path = _tiny_recipe(tmp_path, kind, ep=1)
    on_deepspeed = ["train.engine=deepspeed", "deepspeed.zero_stage=2"]
    assert validate.validate_recipe(path, on_deepspeed, offline=True).ok  # ZeRO alone shards the experts: fine
    bad = [*on_deepspeed, "deepspeed.tp_size=2"]
    refusal = "deepspeed.tp_size: 2 on a mixture-of-experts model"
    assert any(e.startswith(refusal) for e in validate.validate_recipe(path, bad, offline=True).errors)
    assert validate.main([str(path), *bad, "--offline"]) == 2
    assert refusal in capsys.readouterr().out
    with pytest.raises(preflight.RecipeCheckError, match="deepspeed.tp_size: 2 on a mixture-of-experts"):
        preflight.preflight(load_recipe(path, bad), world_size=8)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b-8x8", "mixtral-8x22b-8x8"])
def test_the_run_logs_prediction_is_validates_plan_with_the_experts(name):
    """What a run's log sets beside its measurements (recipes.training.throughput.predict) is the plan
    `recipes.validate` reports for the same recipe: the experts' weights and states per EP rank, not a
    dense model of the active width (Mixtral-8x22B's 8 experts counted as one)."""
    from recipes.config import load_recipe
    from recipes.validation import validate
    from recipes.planning.backbones import resolve_model_config
    from recipes.planning.step_model import GiB
    from recipes.training.throughput import predict

    # the local spec on both sides (a run on CPU predicts it; validate assumes GPUs' TE spec otherwise)
    overrides = ["megatron.transformer_impl=local", "data.seq_len=1024"]
    recipe = load_recipe(SCALE / f"{name}.yaml", overrides)
    cfg, _, _ = resolve_model_config(recipe, offline=True)
    got = predict(recipe, cfg, recipe.cluster.nodes * recipe.cluster.gpus_per_node)
    rep = validate.validate_recipe(SCALE / f"{name}.yaml", overrides, offline=True)
    assert rep.ok, rep.render()
    assert got["memory_gib"] == pytest.approx(rep.numbers["gpu_total_bytes"] / GiB, rel=1e-12)
    assert got["step_s"] == pytest.approx(rep.numbers["step_time_s"], rel=1e-12)
    assert got["mfu"] == pytest.approx(rep.numbers["mfu"], rel=1e-12)
    # and the experts are in it: the same plan without them holds less
    from recipes.planning import step_model

    dense = megatron_plan.plan(recipe, cfg, rows=step_model.row_tokens(recipe), hardware=step_model.hardware(recipe), moe=None,
                               gpus=False)
    assert dense.peak.total / GiB < 0.9 * got["memory_gib"]


@pytest.mark.parametrize("kind, dtype, per_param", [("qwen3_moe", "bfloat16", 2 + 8 + 4), ("mixtral", "float32", 4 + 8)])
def test_a_megatron_checkpoint_holds_each_tensor_once(tmp_path, kind, dtype, per_param):
    """The plan's checkpoint size: every parameter of the HF model once, in the model's dtype, with Adam's two
    fp32 moments and, for a 16-bit model, its fp32 main weight (recipes/engines/megatron/runtime/checkpoints.py)."""
    import numpy as np
    from transformers import AutoModelForCausalLM

    from recipes.config import load_recipe
    from recipes.planning import step_model

    cfg = _config(kind, TINY[kind])
    total = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    recipe = load_recipe(_tiny_recipe(tmp_path, kind), [f"model.dtype={dtype}"])
    pl = megatron_plan.plan(recipe, cfg, hardware=step_model.Hardware(), rows=step_model.Rows(64, 64, "", np.array([64])),
                            timed=False)
    assert pl.checkpoint_bytes == total * per_param
