"""recipes.planning.validate's memory, disk and communication estimates (recipes.planning.budget) and the ZeRO settings
recipes.engines.deepspeed.config derives from the recipe's shape. Numbers are checked against the formulas written out
by hand here for Llama-3-70B (80 layers, h 8192, I 28672, 64 heads of 128, 8 KV heads, V 128256).

What no CPU test can reach: whether the estimates match a real GPU's peak memory and a real network's
step time (they are estimates, stated as such in the report), and `device_map` loading onto a GPU
(recipes.engines.deepspeed.model.load_placement; only its choice is checked here).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from recipes.planning import validate as V
from recipes.config import load_recipe
from recipes.engines.deepspeed.config import deepspeed_config

CONFIGS = Path(__file__).resolve().parents[2] / "recipes" / "configs"
R70 = CONFIGS / "scale" / "llama3-70b-4x8.yaml"
L, H, I, KVD, VOCAB = 80, 8192, 28672, 8 * 128, 128256


@pytest.fixture(scope="module")
def base():
    """The shipped 70B recipe on 4 x 8 GPUs (gradient checkpointing on, chunked head, ZeRO-3)."""
    rep = V.validate_recipe(R70, offline=True, seq_len=1024)
    assert rep.ok, rep.render()
    return rep


def test_activations_with_and_without_checkpointing(base, capsys):
    from recipes.planning.budget import Shape, activation_bytes

    tokens = 1 * 1024
    full_layer = tokens * (4 * H + 3 * H + 3 * KVD + 4 * I) * 2  # bf16
    assert base.numbers["activation_bytes"] == int(L * H * tokens * 2 + full_layer)  # checkpointing on
    # chunked: 1024 tokens, so a vocab chunk holds 1024 / 8 tokens' worth of logits (bf16 and fp32), plus
    # d hidden's fp32 accumulator and a bf16 product
    assert base.numbers["head_bytes"] == int(128 * VOCAB * 6 + tokens * H * 6)
    shape = Shape(layers=L, hidden=H, intermediate=I, heads=64, kv_heads=8, head_dim=128, vocab=VOCAB)
    assert activation_bytes(shape, 4096, 1, 4096, 2, checkpointing=False) == L * 4096 * (4 * H + 3 * H + 3 * KVD + 4 * I) * 2
    # off at 4096 tokens: ~107 GiB of activations alone; validate exits 1 and names the part
    assert V.main([str(R70), "model.gradient_checkpointing=false", "--offline", "--seq-len", "4096"]) == 1
    out = capsys.readouterr().out
    assert "ERROR    memory:" in out and "does not fit 80 GiB" in out
    assert "the largest part is activations (gradient checkpointing off)" in out
    assert "turn on model.gradient_checkpointing" in out


def test_logits_head_is_counted_and_can_be_what_does_not_fit():
    rep = V.validate_recipe(R70, ["loss.head=logits", "train.micro_batch_size=8", "train.grad_accum=1",
                                  "train.global_batch_size=256"], offline=True, seq_len=4096)
    assert rep.numbers["head_bytes"] == 8 * 4096 * VOCAB * 12  # [T, V] bf16 logits + fp32 copy + grads
    assert any(e.startswith("memory:") and f"head (logits) {8 * 4096 * VOCAB * 12 / 2**30:.1f} GiB" in e
               for e in rep.errors), rep.errors


def test_communication_per_step_and_hpz(base):
    rep = base
    p = rep.numbers["params"]
    ring = 31 / 32  # 32 data-parallel ranks
    # per micro-batch (2 per step): forward gather (bf16) + reduce-scatter (fp32) over the network; the
    # backward gather stays inside the node (hpZ 8)
    assert rep.numbers["comm_inter_node_bytes"] == int(2 * (p * 2 * ring + p * 4 * ring))
    assert rep.numbers["comm_intra_node_bytes"] == int(2 * p * 2 * ring)
    assert rep.numbers["step_flops"] == 8 * p * 1024 * 2  # checkpointing: the forward runs twice
    ratio = (rep.numbers["comm_inter_node_bytes"] / 50e9) / (rep.numbers["step_flops"] / 400e12)
    assert rep.numbers["comm_compute_ratio"] == pytest.approx(ratio)
    assert any("comm / GPU / step" == k and "hpZ 8" in v and "ratio" in v for k, v in rep.info)


def test_host_ram_at_load_and_export_and_disk(base):
    rep = V.validate_recipe(R70, ["deepspeed.zero_stage=2", "deepspeed.tp_size=8", "loss.head=logits",
                                  "train.global_batch_size=8", "cluster.host_mem_gb=1000"], offline=True)
    p = rep.numbers["params"]
    assert rep.numbers["host_load_bytes"] == 8 * p * 2  # ZeRO-2 + AutoTP: the whole bf16 model on each of 8 ranks
    assert any(e.startswith("cluster.host_mem_gb") and "use ZeRO-3" in e for e in rep.errors), rep.errors
    tp1 = V.validate_recipe(R70, ["deepspeed.zero_stage=2", "cluster.host_mem_gb=1000"], offline=True)
    assert tp1.numbers["host_load_bytes"] == 8 * 5 * 2**30  # streamed to the GPU a shard at a time
    assert not any(e.startswith("cluster.host_mem_gb") for e in tp1.errors)
    # under optimizer offload DeepSpeed's CPU estimate (fp32 states on the host) counts
    off = V.validate_recipe(R70, ["deepspeed.offload_optimizer=true", "cluster.host_mem_gb=200"], offline=True)
    assert off.numbers["cpu_mem_bytes"] > 200 * 2**30
    assert any(e.startswith("cluster.host_mem_gb: 200 GiB") for e in off.errors), off.errors
    z3 = base  # cluster.host_mem_gb unset: reported, not checked
    largest = z3.numbers["largest_layer_params"]
    assert z3.numbers["host_export_bytes"] == int(8 * (p * 2 / 32 + largest * 2))
    assert z3.numbers["disk_bytes"] == int(p * (2 + 4 + 8) * 2 + p * 2)  # keep_last 2 + the export


def test_zero3_settings_follow_the_shape():
    tiny = {"model_type": "llama", "hidden_size": 256}
    recipe = load_recipe(R70, ["model.name_or_path=null", f"model.config={tiny}", "model.tokenizer=t"])
    zero = deepspeed_config(recipe, 32)["zero_optimization"]
    assert zero["overlap_comm"] is True and zero["contiguous_gradients"] is True
    assert zero["zero_hpz_partition_size"] == 8  # one node's data-parallel ranks
    assert zero["reduce_bucket_size"] == 256 * 256 and zero["stage3_prefetch_bucket_size"] == int(0.9 * 256 * 256)
    assert zero["stage3_param_persistence_threshold"] == 2560
    config = deepspeed_config(recipe, 32)
    assert config["communication_data_type"] == "fp32" and config["data_types"] == {"grad_accum_dtype": "fp32"}
    one_node = deepspeed_config(load_recipe(R70, ["cluster.nodes=1", "train.global_batch_size=16"]), 8)
    assert "zero_hpz_partition_size" not in one_node["zero_optimization"]
    z0 = deepspeed_config(load_recipe(R70, ["deepspeed.zero_stage=0"]), 32)
    assert z0["zero_optimization"] == {"stage": 0} and "data_types" not in z0
    # the recipe's overrides still win
    custom = deepspeed_config(load_recipe(R70, ["deepspeed.overrides={zero_optimization: {overlap_comm: false}}"]), 32)
    assert custom["zero_optimization"]["overlap_comm"] is False


def test_weights_load_onto_the_gpu_below_zero3_without_tp():
    import torch

    from recipes.engines.deepspeed.model import load_placement

    gpu = torch.device("cuda", 3)
    recipe = load_recipe(R70, ["deepspeed.zero_stage=2"])
    assert load_placement(recipe, gpu) == {"device_map": {"": gpu}}
    assert load_placement(recipe, torch.device("cpu")) == {}
    assert load_placement(load_recipe(R70), gpu) == {}  # ZeRO-3: partitioned by HfDeepSpeedConfig
    assert load_placement(load_recipe(R70, ["deepspeed.zero_stage=2", "deepspeed.tp_size=8", "loss.head=logits",
                                            "train.global_batch_size=8"]), gpu) == {}
