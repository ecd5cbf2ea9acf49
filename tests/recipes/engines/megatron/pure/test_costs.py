"""recipes.engines.megatron.pure.costs and placement, recipes.engines.megatron.pure.plan: the Megatron engine's layout
checks, memory, bubble, traffic and step time in `python -m recipes.validate`, checked against numbers
worked out by hand here for Llama-3-70B (80 layers, h 8192, I 28672, 64 heads of 128, 8 KV heads, V 128256
padded to 129024 at TP 8) and a tiny shape (the step model's terms against a coarser hand model:
test_step_model.py). What no CPU test reaches: whether the estimates match a GPU's peak memory and a
cluster's step time.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from recipes.planning import gemm_rates
from recipes.engines.megatron.pure import costs as megatron_costs
from recipes.planning import placement
from recipes.planning import step_model
from recipes.planning.shape import Shape
from recipes.planning.step_model import GiB
from recipes.validation import validate

CONFIGS = Path(__file__).resolve().parents[5] / "recipes" / "configs"
MEG70 = CONFIGS / "scale" / "llama3-70b-megatron-tp8pp4.yaml"
MEG8 = CONFIGS / "llama3-8b-gsm8k" / "megatron.yaml"
S70 = Shape(layers=80, hidden=8192, intermediate=28672, heads=64, kv_heads=8, head_dim=128, vocab=128256)
S8 = Shape(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256)
LAYER70 = 8192 * 8192 * 2 + 8192 * 1024 * 2 + 3 * 8192 * 28672  # q, o; k, v; gate, up, down = 855,638,016


# the layout the by-hand figures below are written for (the recipe ships 4 rows x 16: its comment says why)
ONE_ROW = ["train.micro_batch_size=1", "train.grad_accum=64"]


@pytest.fixture(scope="module")
def meg70():
    rep = validate.validate_recipe(MEG70, ONE_ROW, offline=True, seq_len=1024)
    assert rep.ok, rep.render()
    return rep


def test_model_states_against_the_formula(meg70):
    # TP 8 x PP 4 x DP 1, stage 0: 20 layers' TP shards (norms replicated) + the embedding's shard of the
    # padded vocabulary; 2 + 4 + 12/1 = 18 bytes per parameter
    assert LAYER70 == 855_638_016 and megatron_costs.padded_vocab(128256, 8) == 129024
    stage0 = 20 * (LAYER70 // 8 + 2 * 8192) + 129024 * 8192 // 8
    assert stage0 == 2_271_543_296
    assert meg70.numbers["peak_stage"] == 0
    assert meg70.numbers["gpu_mem_bytes"] == stage0 * 18
    # TP 8 x PP 2 x DP 2, last stage: 40 layers + output layer + final norm, 6 + 12/2 bytes; 18 without the
    # distributed optimizer
    lay = placement.Placement.of(tp=8, pp=2, dp=2, gpus_per_node=8)
    last = 40 * (LAYER70 // 8 + 2 * 8192) + 129024 * 8192 // 8 + 8192
    assert megatron_costs.stage_params(S70, lay, 1, tied=False) == last
    assert megatron_costs.model_state_bytes(last, 2, True) == last * 12
    assert megatron_costs.model_state_bytes(last, 2, False) == last * 18
    # the stages add up to the model: TP shards x 8, minus the replicated norms' copies and the padding
    lay4 = placement.Placement.of(tp=8, pp=4, dp=1)
    held = sum(megatron_costs.stage_params(S70, lay4, r, tied=False) for r in range(4)) * 8
    assert held - 7 * (80 * 2 * 8192 + 8192) - 2 * (129024 - 128256) * 8192 == 70_553_706_496


def test_bubble_1f1b_and_interleaved():
    assert megatron_costs.bubble(4, 8) == pytest.approx(3 / 11)  # (p - 1) / (m + p - 1)
    assert megatron_costs.bubble(4, 8, 2) == pytest.approx(1.5 / 9.5)  # (p - 1)/v idle slots out of m + (p - 1)/v
    assert megatron_costs.bubble(1, 8) == 0
    rep = validate.validate_recipe(MEG70, [*ONE_ROW, "train.grad_accum=8", "train.global_batch_size=8"], offline=True,
                            seq_len=1024)
    assert rep.numbers["bubble"] == pytest.approx(3 / 11)
    rep = validate.validate_recipe(MEG70, [*ONE_ROW, "train.grad_accum=8", "train.global_batch_size=8",
                                    "megatron.virtual_pp_size=2"],
                            offline=True, seq_len=1024)
    assert rep.ok, rep.render()
    assert rep.numbers["bubble"] == pytest.approx(3 / 19)


def test_in_flight_micro_batches():
    lay = placement.Placement.of(tp=8, pp=4, dp=1)
    assert [megatron_costs.layers_in_flight(lay, 80, 64, r) for r in range(4)] == [80, 60, 40, 20]  # min(p - r, m) x L/p
    assert megatron_costs.layers_in_flight(lay, 80, 2, 0) == 40  # fewer micro-batches than stages
    inter = placement.Placement.of(tp=8, pp=4, dp=1, vpp=2)
    assert megatron_costs.layers_in_flight(inter, 80, 8, 0) == pytest.approx(80 * (1 + 3 / 8))  # L (1 + (p - 1)/(p v))


def test_tp_bytes_per_layer_small_shape():
    s = Shape(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=4, head_dim=16, vocab=1000)
    u = 2 * 16 * 64 * 2  # [T, h] in bf16: 2 rows x 16 tokens
    for sp, per_layer, embedding, head in ((False, 8, 2, 2), (True, 10, 1, 3)):
        lay = placement.Placement.of(tp=4, pp=1, dp=1, sp=sp, gpus_per_node=4)
        pl = megatron_costs.estimate(s, lay, micro_batch_size=2, seq=16, grad_accum=3, tied=True)
        # (2 layers x 8 [SP: 10] + embedding 2 [SP: a reduce-scatter, 1] + output layer 2 [SP: 3]) x U x 3/4,
        # x 3 micro-batches
        assert pl.stages[0].tp_bytes == pytest.approx(3 * (2 * per_layer + embedding + head) * u * 3 / 4)
    assert u * 8 * 3 / 4 == 24576  # one layer, no SP: 4 all-reduces of 4 KiB, each sending 2 x 3/4 of it


def test_rank_order_is_megatrons():
    core = pytest.importorskip("megatron.core.parallel_state")
    for tp, dp, pp in ((8, 1, 4), (2, 4, 2), (4, 2, 4), (1, 8, 1)):
        gen = core.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
        for kind in ("tp", "dp", "pp"):
            assert placement.groups(placement.Placement.of(tp, pp, dp), kind) == sorted(gen.get_ranks(kind)), (tp, dp, pp, kind)


def test_where_rings_go():
    lay = placement.Placement.of(tp=2, pp=1, dp=8, gpus_per_node=8)  # 2 nodes: DP ranks 2 apart, 4 on each node
    group = placement.groups(lay, "dp")[0]
    assert group == [0, 2, 4, 6, 8, 10, 12, 14]
    assert placement.split_ring(lay, group, 800.0) == (200.0, 600.0)  # a quarter over each GPU's NIC
    one = placement.Placement.of(tp=2, pp=2, dp=2, gpus_per_node=8)
    assert placement.split_ring(one, placement.groups(one, "dp")[0], 800.0) == (0.0, 800.0)
    # TP 8 x PP 4 on 4 nodes: each stage a node, p2p over the network; stage 1 sends 64 activations
    # [1024, 8192] / 8 (SP) forward and 64 gradients back
    pl = megatron_costs.estimate(S70, placement.Placement.of(tp=8, pp=4, dp=1, sp=True), micro_batch_size=1, seq=1024, grad_accum=64, tied=False)
    assert pl.stages[1].pp_inter == 2 * 64 * 1024 * 8192 * 2 / 8 and pl.stages[1].pp_intra == 0
    assert pl.stages[3].pp_inter == 64 * 1024 * 8192 * 2 / 8  # the last stage sends gradients only


def test_step_time_by_hand(meg70):
    """The plan's step at 1024-token rows assembled by hand from its terms (recipes.planning.step_model):
    the last stage (the output layer's GEMMs and collectives) is the slowest, (64 + 3) micro-batches."""
    hw = step_model.Hardware()  # an H100: the H200's GEMM rate table
    table = hw.rates()
    gemm_s, gemm_f = gemm_rates.layer_gemm_seconds(table, 1024, gemm_rates.gemm_shapes(8192, 28672, 64, 8, 128, 8))
    attention = 6 * 1024 * 1024 * 64 * 128 / 8 * gemm_s / gemm_f  # causal, 1/8 of the heads, at the layer's rate
    kernels = 42 * 5e-6  # Transformer Engine's layer, forward and backward
    vocab = 129024 / 8
    head = 6 * 1024 * vocab * 8192 / (table.tflops(gemm_rates.intensity(1024, vocab, 8192)) * 1e12)
    u = 1024 * 8192 * 2
    # NCCL's fastest protocol for each SP all-gather / reduce-scatter of 7/8 u over 8 GPUs at 360 GB/s
    call = min(latency + u * 7 / 8 / (360e9 * share)
               for latency, share in ((6.6e-6 + 7 * 0.6e-6, 0.5), (14e-6 + 7 * 1.9e-6, 0.92), (8.4e-6 + 7 * 3.4e-6, 1)))
    tp = (20 * 10 + 3) * call  # SP: 10 per layer, the output layer 3
    p2p = 8.4e-6 + 14e-6 + (u / 8) / 50e9  # the gradient back to stage 2, over a 400 Gb/s NIC
    step = (64 + 3) * (20 * (gemm_s + attention + kernels) + head + tp + p2p)  # DP 1: no DP traffic
    assert meg70.numbers["step_time_s"] == pytest.approx(step)
    flops = (6 * (80 * LAYER70 + 128256 * 8192) + 6 * 1024 * 64 * 128 * 80) * 64 * 1024
    assert meg70.numbers["mfu"] == pytest.approx(flops / (step * 32 * 989e12))
    # DeepSpeed's column: max(compute, communication) (recipes.engines.deepspeed.pure.costs)
    ds = validate.validate_recipe(CONFIGS / "scale" / "llama3-70b-4x8.yaml", offline=True, seq_len=1024)
    n = ds.numbers
    assert n["step_time_s"] == pytest.approx(max(n["t_compute_s"], n["t_comm_s"]))


@pytest.mark.parametrize("overrides, message", [
    (["megatron.pp_size=3"], ("megatron.tp_size x megatron.pp_size: 8 x 3 = 24 does not divide cluster.nodes x "
                              "cluster.gpus_per_node = 4 x 8 = 32")),
    (["megatron.tp_size=16", "megatron.pp_size=2"], "megatron.tp_size: 16 does not divide cluster.gpus_per_node 8"),
    (["megatron.virtual_pp_size=3"], ("megatron.pp_size x megatron.virtual_pp_size: 4 x 3 does not divide the "
                                      "model's 80 layers")),
    (["megatron.tp_size=16", "megatron.pp_size=2", "cluster.gpus_per_node=16", "cluster.nodes=2"],
     "megatron.tp_size: 16 does not divide the model's 8 KV heads"),
    (["megatron.virtual_pp_size=2", "train.grad_accum=6", "train.global_batch_size=6"],
     "train.grad_accum: 6 micro-batches must be a multiple of megatron.pp_size 4"),
    (["megatron.tp_size=1", "megatron.pp_size=1", "train.grad_accum=2"],
     "megatron.sequence_parallel: needs megatron.tp_size > 1"),
    (["train.grad_accum=32"], "train.global_batch_size: 64 != micro_batch_size 4 x grad_accum 32 x data-parallel 1"),
])
def test_layouts_that_do_not_divide_are_refused(overrides, message, capsys):
    rep = validate.validate_recipe(MEG70, overrides, offline=True, seq_len=1024)
    assert any(message in e for e in rep.errors), rep.errors
    # a layout the model or the cluster cannot take, or one the recipe refuses as it loads (SP without
    # TP): exit 2; the global batch's arithmetic is an error in the recipe: exit 1
    assert validate.main([str(MEG70), *overrides, "--offline"]) == (1 if "global_batch_size" in message else 2)
    assert message in capsys.readouterr().out


def test_shipped_megatron_recipes_fit_80gb():
    for path in (MEG70, MEG8):
        rep = validate.validate_recipe(path, offline=True, seq_len=1024, gpu_mem_gb=80)
        assert rep.ok, rep.render()
        assert 0 < rep.numbers["gpu_total_bytes"] < 80 * GiB
        assert any(k == "step time" and "MFU" in v for k, v in rep.info)
    assert "TP 8 + SP x PP 4 x DP 1" in dict(validate.validate_recipe(MEG70, offline=True, size=False).info)["layout"]


def test_shipped_8b_layout_is_the_fastest_that_fits():
    """The 8B recipe's comment: TP 1 x PP 1 x DP 8 is what the model finds fastest on one node of 8."""
    times = {}
    for tp, pp in ((1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (8, 1), (4, 2)):
        dp = 8 // (tp * pp)
        lay = placement.Placement.of(tp, pp, dp, sp=tp > 1)
        pl = megatron_costs.estimate(S8, lay, micro_batch_size=2, seq=1024, grad_accum=64 // (2 * dp), tied=False)
        if pl.peak.total < 80 * GiB:
            times[(tp, pp)] = pl.step_s
    assert min(times, key=times.get) == (1, 1)


def test_full_recompute_lowers_activations(meg70):
    full = validate.validate_recipe(MEG70, [*ONE_ROW, "megatron.recompute=full"], offline=True, seq_len=1024)
    sel = validate.validate_recipe(MEG70, [*ONE_ROW, "megatron.recompute=selective"], offline=True, seq_len=1024)
    key = "first_stage_activation_bytes"  # the first stage holds the most micro-batches
    none = meg70.numbers[key]
    assert full.numbers[key] < sel.numbers[key] < none
    # none: per token e (4h/t [SP] + (2ad + 2kd + 4I)/t) + 4a/t bytes, x 1024 tokens x 80 layer-micro-batches
    per_token = 2 * (4 * 8192 / 8 + (2 * 8192 + 2 * 1024 + 4 * 28672) / 8) + 4 * 64 / 8
    assert none == int(80 * 1024 * per_token)
    # full: each layer's input (e h / t under SP) + one layer rebuilt at a time
    assert full.numbers[key] == int(80 * 1024 * 2 * 8192 / 8 + 1024 * per_token)
    assert full.numbers["peak_stage"] == 3  # then the last stage, with the output layer and logits, is the peak
    assert full.numbers["step_time_s"] > meg70.numbers["step_time_s"]  # a forward again: slower
