"""Routing imbalance in the Megatron plan of an MoE model (recipes/planning/moe.py's docstring,
`MoEShape.imbalance`, validate's --moe-imbalance): at 1.0 the plan is the balanced one (the stage's numbers
pinned below are the balanced plan's, so a factor of 1 changes none of them); at f the busiest EP rank's
expert activations and
all-to-all bytes are f times the balanced ones, worked out by hand here, and its memory grows by exactly
the difference; below 1 the factor is refused."""

from dataclasses import replace

import pytest
import yaml

from recipes.engines.megatron.pure import costs as megatron_costs
from recipes.planning import placement
from recipes.planning import moe as moe_math
from recipes.planning.shape import Shape
from recipes.planning.moe import MoEShape

H, I, LAYERS, E, K = 256, 512, 4, 8, 2  # a tiny Mixtral
MBS, SEQ, ACCUM = 2, 128, 2
T = MBS * SEQ  # tokens per micro-batch


def _model():
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("mixtral", vocab_size=1024, hidden_size=H, intermediate_size=I, num_hidden_layers=LAYERS,
                               num_attention_heads=8, num_key_value_heads=4, num_local_experts=E, num_experts_per_tok=K)
    return Shape.of(cfg), MoEShape.of(cfg)


def _plan(imbalance=None, ep=4, recompute=None, timed=True):
    shape, moe = _model()
    if imbalance is not None:
        moe = replace(moe, imbalance=imbalance)
    lay = placement.Placement.of(1, 1, 8, gpus_per_node=4, ep=ep)  # EP 4 inside a node of 4 GPUs
    return megatron_costs.estimate(shape, lay, micro_batch_size=MBS, grad_accum=ACCUM, tied=False, seq=SEQ, moe=moe, recompute=recompute,
                  timed=timed)


# the balanced plan's stage at TP 1 x PP 1 x DP 8, EP 4 (routing without an imbalance factor)
BEFORE = {
    None: dict(memory={"model states": 9909120.0, "expert states": 37748736.0, "activations": 14254080.0,
                       "head": 3407872.0, "buffers": 2151309312.0}, ep_intra=6291456.0, t_ep=0.00015187626666666662,
               t_compute=0.001513316570927599, step_s=0.0033303856751885313, flops_mb=6656360448.0),
    "full": dict(memory={"model states": 9909120.0, "expert states": 37748736.0, "activations": 4087808.0,
                         "head": 3407872.0, "buffers": 2151309312.0}, ep_intra=9437184.0, t_ep=0.00022781439999999993,
                 t_compute=0.001816402584975022, step_s=0.004088433969950044, flops_mb=8740929536.0),
}


@pytest.mark.parametrize("recompute", [None, "full"])
@pytest.mark.parametrize("imbalance", [None, 1.0, 1])
def test_an_imbalance_of_1_is_the_balanced_plan(recompute, imbalance):
    pl = _plan(imbalance, recompute=recompute)
    st, want = pl.stages[0], BEFORE[recompute]
    assert st.memory == want["memory"]
    assert st.ep_inter == 0 and st.ep_intra == want["ep_intra"] and st.flops_mb == want["flops_mb"]
    assert st.t_ep == pytest.approx(want["t_ep"], rel=1e-12)
    assert st.t_compute == pytest.approx(want["t_compute"], rel=1e-12)
    assert pl.step_s == pytest.approx(want["step_s"], rel=1e-12)


@pytest.mark.parametrize("recompute, layers_kept", [(None, LAYERS + 1), ("selective", LAYERS + 1), ("full", 2)])
def test_at_2_the_busiest_ranks_expert_activations_and_all_to_all_double(recompute, layers_kept):
    """Per MoE layer per micro-batch the busiest of 4 EP ranks receives f T k tokens: the experts' input (e h
    each) and SwiGLU intermediates (4 e I) are f T k e (h + 4 I) bytes, kept by each layer in flight (4,
    pp 1) and the buffers' one layer (full recompute: the one layer rebuilt and the buffers' one); its
    all-to-alls move f x 4 (6 under full recompute) x T k h e (ep - 1)/ep per layer per micro-batch."""
    e, ep = 2, 4
    balanced_layer = T * K * e * (H + 4 * I)
    assert balanced_layer == moe_math.routed_activation_bytes(_model()[1], H, T, 1, e) == 2_359_296
    balanced_acts = layers_kept * balanced_layer
    calls = LAYERS * (6 if recompute == "full" else 4) * ACCUM
    balanced_a2a = calls * T * K * H * e * (ep - 1) / ep
    one, two = (_plan(f, ep=ep, recompute=recompute).stages[0] for f in (1.0, 2.0))
    assert one.expert_activations == balanced_acts and two.expert_activations == 2 * balanced_acts
    assert one.ep_inter == two.ep_inter == 0  # the EP group inside a node
    assert one.ep_intra == balanced_a2a and two.ep_intra == 2 * balanced_a2a
    assert two.total - one.total == two.expert_activations - one.expert_activations == balanced_acts
    assert {k: v for k, v in two.memory.items() if k not in ("activations", "buffers")} == {
        k: v for k, v in one.memory.items() if k not in ("activations", "buffers")}
    assert two.memory["buffers"] - one.memory["buffers"] == balanced_layer
    assert one.t_ep < two.t_ep < 2 * one.t_ep  # the bytes' time doubles, the calls' latency does not


def test_at_2_the_busiest_ranks_expert_gemms_run_twice_the_tokens():
    """expert_compute: the routed experts' GEMMs (gate + up, down; forward and two backward) of the busiest
    rank at f T k ep / E tokens per expert; the router's at T tokens whatever f."""
    from recipes.planning.step_model import Hardware

    _, moe = _model()
    table, ep = Hardware().rates("bfloat16"), 4
    router = 3 * 2 * T * H * E
    for f in (1.0, 2.0):
        per_expert = T * K * ep / E * f
        routed = 3 * 2 * per_expert * (H * 2 * I + I * H) * E / ep
        assert moe_math.expert_compute(table, replace(moe, imbalance=f), H, T, 1, ep)[1] == routed + router


def test_the_factor_has_no_effect_at_ep_1_and_is_capped_at_what_one_rank_can_receive():
    """At EP 1 every GPU runs its own tokens' experts; the busiest of ep ranks receives at most every
    token's copies its E / ep experts can take: ep min(k, E / ep) / k times the mean (E 8, k 2: EP 2 at
    most x2, EP 8 at most x4)."""
    _, moe = _model()
    f3 = replace(moe, imbalance=3.0)
    assert f3.busiest_share(1) == 1 and f3.busiest_share(2) == 2 and f3.busiest_share(4) == 3 and f3.busiest_share(8) == 3
    assert replace(moe, imbalance=9.0).busiest_share(8) == 4
    ep1 = _plan(3.0, ep=1).stages[0]
    assert ep1.memory == _plan(1.0, ep=1).stages[0].memory and ep1.ep_intra == 0
    assert _plan(3.0, ep=2).stages[0].expert_activations == 2 * _plan(1.0, ep=2).stages[0].expert_activations


@pytest.mark.parametrize("bad", [0.5, 0.999, 0, -1, float("nan"), float("inf"), "2", True])
def test_an_imbalance_below_1_is_refused(bad):
    _, moe = _model()
    with pytest.raises(ValueError, match="moe imbalance: .* is not a number >= 1.0"):
        replace(moe, imbalance=bad)


def _recipe(tmp_path, kind="mixtral"):
    path = tmp_path / f"{kind}.yaml"
    config = dict(model_type="mixtral", vocab_size=97, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    if kind == "llama":
        config = dict(model_type="llama", vocab_size=97, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    path.write_text(yaml.safe_dump({
        "name": kind, "model": {"config": config, "tokenizer": "unused"}, "data": {"train": "unused"},
        "train": {"engine": "megatron", "micro_batch_size": 1, "grad_accum": 1},
        "megatron": {"tp_size": 1, "ep_size": 2}, "cluster": {"nodes": 1, "gpus_per_node": 8}}))
    return path


def test_validate_plans_and_shows_the_imbalance(tmp_path, capsys):
    from recipes.validation import validate

    path = _recipe(tmp_path)
    one = validate.validate_recipe(path, offline=True, seq_len=256)
    two = validate.validate_recipe(path, offline=True, seq_len=256, moe_imbalance=2.0)
    assert one.ok and two.ok, (one.errors, two.errors)
    n1, n2 = one.numbers, two.numbers
    assert n1["moe_imbalance"] == 1 and n2["moe_imbalance"] == 2 and n2["moe_busiest_share"] == 2
    assert n2["expert_activation_bytes"] == 2 * n1["expert_activation_bytes"] > 0
    assert n2["gpu_total_bytes"] - n1["gpu_total_bytes"] == n1["expert_activation_bytes"]
    assert n2["ep_intra_node_bytes"] == 2 * n1["ep_intra_node_bytes"]
    assert "balanced routing assumed" in dict(one.info)["expert parallel"]
    assert "routing imbalance x2 (--moe-imbalance)" in dict(two.info)["expert parallel"]
    assert validate.main([str(path), "--offline", "--moe-imbalance", "1.5"]) == 0
    assert "routing imbalance x1.5" in capsys.readouterr().out


def test_validate_refuses_an_imbalance_below_1_with_exit_2(tmp_path, capsys):
    from recipes.validation import validate

    path = _recipe(tmp_path)
    rep = validate.validate_recipe(path, offline=True, moe_imbalance=0.5)
    assert rep.errors == ["--moe-imbalance: moe imbalance: 0.5 is not a number >= 1.0: it is the tokens the busiest EP "
                          "rank receives over the mean (1.0: balanced routing; the busiest rank never receives less "
                          "than the mean)"]
    with pytest.raises(SystemExit) as exit_:
        validate.main([str(path), "--offline", "--moe-imbalance", "0.5"])
    assert exit_.value.code == 2
    assert "argument --moe-imbalance: moe imbalance: 0.5 is not a number >= 1.0" in capsys.readouterr().err


def test_a_dense_model_ignores_the_imbalance_with_a_warning(tmp_path):
    from recipes.validation import validate

    path = _recipe(tmp_path, "llama")
    rep = validate.validate_recipe(path, ["megatron.ep_size=1"], offline=True, seq_len=256, moe_imbalance=2.0)
    assert rep.ok, rep.errors
    assert "--moe-imbalance 2: the model has no experts; ignored" in rep.warnings
    assert rep.numbers["gpu_total_bytes"] == validate.validate_recipe(path, ["megatron.ep_size=1"], offline=True,
                                                               seq_len=256).numbers["gpu_total_bytes"]
