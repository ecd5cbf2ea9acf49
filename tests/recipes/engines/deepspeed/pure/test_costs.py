"""recipes.engines.deepspeed.pure.costs / recipes.engines.deepspeed.pure.plan / recipes.engines.deepspeed.pure.report /
step_model: the DeepSpeed engine's memory, traffic and step time in `python -m recipes.validate`, checked
against DeepSpeed's own memory estimator at every shipped recipe and against figures worked out by hand
here for Llama-3-70B (80 layers, h 8192, I 28672, 64 heads of 128, 8 KV heads, V 128256). The traffic formulas are checked against bytes counted in a real gloo run
in test_traffic_gloo.py.

What no CPU test can reach: whether the estimates match a real GPU's peak memory and a real cluster's step
time (they are estimates, stated as such in the report), and `device_map` loading onto a GPU
(recipes.engines.deepspeed.runtime.model.load_placement; only its choice is checked here).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recipes.config import load_recipe
from recipes.engines.deepspeed.pure.config import deepspeed_config
from recipes.engines.deepspeed.pure import plan as deepspeed_plan
from recipes.engines.deepspeed.pure import costs
from recipes.planning import step_model
from recipes.planning.shape import Shape
from recipes.validation import validate

CONFIGS = Path(__file__).resolve().parents[5] / "recipes" / "configs"
R70 = CONFIGS / "scale" / "llama3-70b-4x8.yaml"
TP8 = CONFIGS / "scale" / "llama3-70b-8x8-tp8.yaml"
R8 = CONFIGS / "llama3-8b-gsm8k" / "smmd.yaml"
L, H, I, KVD, VOCAB = 80, 8192, 28672, 8 * 128, 128256
P70 = 70_553_706_496
S70 = Shape(layers=L, hidden=H, intermediate=I, heads=64, kv_heads=8, head_dim=128, vocab=VOCAB)
GiB = 2**30


REVIEWED = ["train.micro_batch_size=1", "train.grad_accum=2"]  # the 4x8 recipe at 1 row x 2 micro-batches


@pytest.fixture(scope="module")
def base():
    """The 70B recipe on 4 x 8 GPUs at 1 row x 2 accumulation and 1024-token rows."""
    rep = validate.validate_recipe(R70, REVIEWED, offline=True, seq_len=1024)
    assert rep.ok, rep.render()
    return rep


def _deepspeed_gpu_recipes():
    out = []
    for path in sorted(CONFIGS.rglob("*.yaml")):
        r = load_recipe(path)
        if r.cluster.gpus_per_node and r.train.engine == "deepspeed" and r.model.lora is None:
            out.append(path)
    return out


@pytest.mark.parametrize("path", _deepspeed_gpu_recipes(), ids=lambda p: str(p.relative_to(CONFIGS)))
def test_model_states_equal_deepspeeds_estimator_at_every_shipped_recipe(path):
    """The plan's own model-state bytes (deepspeed_costs.zero_model_states) against DeepSpeed's estimator for the
    recipe's layout (validate prints the estimator's figure as `gpu_mem_bytes`)."""
    rep = validate.validate_recipe(path, offline=True)
    assert rep.ok, rep.render()
    assert rep.numbers["model_states_bytes"] == pytest.approx(rep.numbers["gpu_mem_bytes"], rel=0.01)


@pytest.mark.parametrize("stage, params", [(3, False), (3, True), (2, False), (1, False)])
def test_offloaded_model_states_equal_deepspeeds_estimator(stage, params):
    """Under offload the plan's model states leave what lives in host memory off the GPU, as DeepSpeed's
    estimator does (its optimizer states and gradient partitions; ZeRO-3 its weight partition too)."""
    rep = validate.validate_recipe(R70, [f"deepspeed.zero_stage={stage}", "deepspeed.offload_optimizer=true",
                                  f"deepspeed.offload_params={str(params).lower()}"], offline=True, seq_len=1024,
                            recommend=False)
    full = validate.validate_recipe(R70, [f"deepspeed.zero_stage={stage}"], offline=True, seq_len=1024, recommend=False)
    assert rep.numbers["model_states_bytes"] == pytest.approx(rep.numbers["gpu_mem_bytes"], rel=0.01)
    # by hand, bf16 on 32 GPUs: ZeRO-3 keeps its weight partition (unless offloaded too) and the gathered
    # module with its gradient; ZeRO 1-2 the bf16 weights
    largest = rep.numbers["largest_layer_params"]
    hand = {(3, False): P70 * 2 / 32 + 2 * 2 * largest, (3, True): 2 * 2 * largest}.get((stage, params), 2 * P70)
    assert rep.numbers["model_states_bytes"] == int(hand) < full.numbers["model_states_bytes"]


def test_70b_4x8_memory_with_the_hpz_copy_and_the_refusal_without_checkpointing(base, capsys):
    n = base.numbers
    assert n["params"] == P70
    assert n["hpz_copy_bytes"] == int(2 * P70 / 8)  # bf16 weights sharded over the node's 8 GPUs: 16.4 GiB
    assert 16.4 < n["hpz_copy_bytes"] / GiB < 16.5
    # activations with checkpointing: each layer's input + one layer (fp32 norm inputs, SwiGLU, GQA, lse)
    per_token_layer = 2 * (4 + 4) * H + 2 * (2 * H + 2 * KVD + 4 * I) + 4 * 64
    assert n["activation_bytes"] == int(L * H * 1024 * 2 + per_token_layer * 1024)
    # the peak with everything the plan counts (model states, hpZ copy, buffers, activations, head): ~60-65 GiB
    assert 60 * GiB < n["gpu_total_bytes"] < 65 * GiB
    assert validate.main([str(R70), "model.gradient_checkpointing=false", "--offline", "--seq-len", "1024"]) == 1
    out = capsys.readouterr().out
    assert "ERROR    memory:" in out and "does not fit the 71.19 GiB a plan may fill" in out  # 80 GB: 79.1 GiB seen, 90 % of it usable
    assert "hpZ copy 16.4 GiB" in out and "turn on model.gradient_checkpointing" in out
    # it fits a 141 GiB GPU
    assert validate.validate_recipe(R70, ["model.gradient_checkpointing=false"], offline=True, seq_len=1024,
                             gpu_mem_gb=141).ok


def test_logits_head_is_counted_and_can_be_what_does_not_fit():
    rep = validate.validate_recipe(R70, ["loss.head=logits", "train.micro_batch_size=8", "train.grad_accum=1",
                                  "train.global_batch_size=256"], offline=True, seq_len=4096)
    T = 8 * 4096
    assert rep.numbers["head_bytes"] == int(T * (4 + 4) * H + T * VOCAB * 12)  # final norm + logits path
    assert any(e.startswith("memory:") and "head (logits)" in e for e in rep.errors), rep.errors


def test_70b_4x8_traffic_and_time_by_hand(base):
    n, ring = base.numbers, 31 / 32
    c = n["collectives"]
    # hpZ: one gather over all 32 ranks per step (1/8 of it over the network), the other 3 inside the node
    first = c["parameter all-gather (the step's first forward)"]
    assert first["ring_bytes"] == pytest.approx(P70 * 2 * ring) and first["calls"] == 1
    assert first["net_bytes"] == pytest.approx(P70 * 2 * ring / 8)
    hpz = c["parameter all-gathers (hpZ, inside the node)"]
    assert hpz["calls"] == 3 and hpz["net_bytes"] == 0 and hpz["nvlink_bytes"] == pytest.approx(3 * P70 * 2 * 7 / 8)
    rs = c["gradient reduce-scatter"]  # fp32, every micro-batch
    assert rs["calls"] == 2 and rs["ring_bytes"] == pytest.approx(2 * P70 * 4 * ring)
    # each NCCL call (a layer's gather: 80 layers + embedding + head; an h^2-element gradient bucket) pays
    # a protocol's latency, base + per ring step inside a node + per step across nodes (32 ranks on 4
    # nodes: 28 + 3 steps; NCCL 2.30's LL, LL128, Simple), then the longer of the node's network bytes /
    # (8 NICs x 50 GB/s) and the NVLink bytes / 360 GB/s at the protocol's share of the bandwidth; NCCL
    # takes the fastest
    buckets = -(-P70 // (H * H))
    protocols = {"LL": (6.6, 0.6, 2.7, 0.5), "LL128": (14.0, 1.9, 4.0, 0.92), "Simple": (8.4, 3.4, 14.0, 1.0)}
    for name, messages, inside, across in (("parameter all-gather (the step's first forward)", 82, 28, 3),
                                           ("parameter all-gathers (hpZ, inside the node)", 3 * 82, 7, 0),
                                           ("gradient reduce-scatter", 2 * buckets, 28, 3)):
        v = c[name]
        assert v["messages"] == messages
        bandwidth = max(v["net_bytes"] * 8 / 400e9, v["nvlink_bytes"] / 360e9) / messages
        call = min((base + inside * hop + across * net) * 1e-6 + bandwidth / share
                   for base, hop, net, share in protocols.values())
        assert v["time_s"] == pytest.approx(messages * call)
    comm = sum(v["time_s"] for v in c.values())
    n_mm = L * step_model.layer_matmul_params(S70) + VOCAB * H
    attn = 6 * 1024 * 64 * 128 * L
    tokens = 2 * 1024
    # checkpointing runs every layer's forward again; the chunked head does 4 GEMMs (it recomputes the logits)
    flops = tokens * (6 * (n_mm - VOCAB * H) + attn) * 4 / 3 + tokens * 8 * VOCAB * H
    assert n["step_flops"] == pytest.approx(flops)
    assert n["step_time_s"] == pytest.approx(max(n["t_compute_s"], comm)) and n["t_comm_s"] == pytest.approx(comm)
    assert n["mfu"] == pytest.approx(tokens * (6 * n_mm + attn) / (n["step_time_s"] * 989e12))
    # hpZ: ~1/8 of the gathers' bytes cross the network (one gather over all ranks per step), 1.5-2 s at 50 GB/s
    assert 1.5 < n["comm_inter_node_bytes"] / 50e9 < 2.0
    # the shipped recipe follows the advice: one micro-batch of 2 rows, half the reduce-scatter bytes
    shipped = validate.validate_recipe(R70, offline=True, seq_len=1024, mean_row_tokens=200)
    reviewed = validate.validate_recipe(R70, REVIEWED, offline=True, seq_len=1024, mean_row_tokens=200)
    assert shipped.ok and shipped.numbers["step_time_s"] < 0.6 * reviewed.numbers["step_time_s"]


def test_tp8_data_parallel_ring_crosses_nodes_at_every_hop():
    rep = validate.validate_recipe(TP8, offline=True, seq_len=1024)
    assert rep.ok, rep.render()
    c = rep.numbers["collectives"]
    gathers = c["parameter all-gathers (forward and backward)"]  # no hpZ: one DP rank per node
    assert gathers["nvlink_bytes"] == 0 and gathers["net_bytes"] == pytest.approx(gathers["ring_bytes"])
    assert c["TP all-reduces"]["net_bytes"] == 0
    z = validate.validate_recipe(CONFIGS / "scale" / "llama3-70b-8x8.yaml", offline=True, seq_len=1024)
    assert rep.numbers["step_time_s"] > z.numbers["step_time_s"]  # the worst of the DeepSpeed layouts


def test_advice_only_lists_what_shortens_the_step():
    rep = validate.validate_recipe(R70, REVIEWED, offline=True, seq_len=1024, mean_row_tokens=200)
    tips = rep.numbers["advice"]
    assert any(t.startswith("one micro-batch per step") for t in tips), tips
    assert not any("hpZ" in t for t in tips)  # already on
    assert not any("grad_accum=2" in t or "larger micro-batches or grad_accum" in t for t in tips)
    # TP across the node with ZeRO-3 across nodes: the advice is TP 1 with hpZ
    tp = validate.validate_recipe(TP8, ["train.micro_batch_size=2", "train.grad_accum=4"], offline=True, seq_len=1024,
                           mean_row_tokens=200)  # 2 rows x 4 micro-batches
    assert any(t.startswith("deepspeed.tp_size=1") for t in tp.numbers["advice"])
    # every listed change is predicted faster or cheaper, and fits
    where = costs.placement(4, 8)
    zero = costs.ZeroSettings(zero_stage=3, hpz=8, micro_batch_size=1, grad_accum=2, checkpointing=True,
                              chunked=True, prefetch_bucket=H * I, reduce_bucket=H * H)
    rows, hw = step_model.Rows(200, 1024, ""), step_model.Hardware()
    base = costs.estimate(S70, P70, VOCAB * H, where, zero, rows, hw)
    recipe = load_recipe(R70, REVIEWED)
    tips = deepspeed_plan.layout_changes(recipe, _llama70b(), hardware=hw, rows=rows, params=(P70, VOCAB * H), now=base)
    assert tips
    for tip in tips:
        alt = tip.plan
        assert alt.step_s < base.step_s or alt.step_s * alt.world < base.step_s * where.world
        # fewer, larger GPUs: an H200's usable part (139.8 GiB seen by torch, less 10 %), not its 141 GB
        assert alt.fits(hw.mem_gib) or alt.total <= 0.9 * 139.8 * GiB


def _llama70b():
    from transformers import AutoConfig

    return AutoConfig.for_model("llama", vocab_size=VOCAB, hidden_size=H, intermediate_size=I, num_hidden_layers=L,
                                num_attention_heads=64, num_key_value_heads=8)


def test_reduce_dtype_bf16_halves_the_gradient_bytes():
    fp32 = validate.validate_recipe(R70, offline=True, seq_len=1024)
    bf16 = validate.validate_recipe(R70, ["deepspeed.reduce_dtype=bf16"], offline=True, seq_len=1024)
    rs = "gradient reduce-scatter"
    assert bf16.numbers["collectives"][rs]["ring_bytes"] == pytest.approx(
        fp32.numbers["collectives"][rs]["ring_bytes"] / 2)
    recipe = load_recipe(R70, ["deepspeed.reduce_dtype=bf16"])
    assert deepspeed_config(recipe, 32)["communication_data_type"] == "bf16"
    assert deepspeed_config(load_recipe(R70), 32)["communication_data_type"] == "fp32"


def test_host_ram_at_load_and_export_and_disk(base):
    rep = validate.validate_recipe(R70, ["deepspeed.zero_stage=2", "deepspeed.tp_size=8", "loss.head=logits",
                                  "train.global_batch_size=8", "cluster.host_mem_gb=1000"], offline=True)
    p = rep.numbers["params"]
    assert rep.numbers["host_load_bytes"] == 8 * p * 2  # ZeRO-2 + AutoTP: the whole bf16 model on each of 8 ranks
    assert any(e.startswith("cluster.host_mem_gb") and "use ZeRO-3" in e for e in rep.errors), rep.errors
    tp1 = validate.validate_recipe(R70, ["deepspeed.zero_stage=2", "cluster.host_mem_gb=1000"], offline=True)
    assert tp1.numbers["host_load_bytes"] == 8 * 5 * 2**30  # streamed to the GPU a shard at a time
    assert not any(e.startswith("cluster.host_mem_gb") for e in tp1.errors)
    assert tp1.numbers["checkpoint_bytes"] == p * (2 + 12)  # ZeRO 0-2 also save the bf16 module
    off = validate.validate_recipe(R70, ["deepspeed.offload_optimizer=true", "cluster.host_mem_gb=200"], offline=True)
    assert off.numbers["cpu_mem_bytes"] > 200 * 2**30
    assert any(e.startswith("cluster.host_mem_gb: 200 GiB") for e in off.errors), off.errors
    largest = base.numbers["largest_layer_params"]
    assert base.numbers["host_export_bytes"] == int(8 * (p * 2 / 32 + largest * 2))
    # ZeRO-3 saves fp32 master weights + Adam's moments, 12 bytes per parameter: 847 GB at 70B
    assert base.numbers["checkpoint_bytes"] == p * 12 and round(p * 12 / 1e9) == 847
    keep = load_recipe(R70).train.keep_last
    assert base.numbers["disk_bytes"] == int(p * 12 * keep + p * 2)


def test_frequent_saves_are_flagged():
    rep = validate.validate_recipe(R70, ["train.save_every=50"], offline=True, seq_len=1024)
    assert any(w.startswith("train.save_every: 50 steps") for w in rep.warnings), rep.warnings


def test_zero3_settings_follow_the_shape():
    tiny = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 1024}
    recipe = load_recipe(R70, ["model.name_or_path=null", f"model.config={tiny}", "model.tokenizer=t"])
    zero = deepspeed_config(recipe, 32)["zero_optimization"]
    assert zero["overlap_comm"] is True and zero["contiguous_gradients"] is True
    assert zero["zero_hpz_partition_size"] == 8  # one node's data-parallel ranks
    # the prefetch bucket holds a layer's largest matrix (h x I) when that is more than 0.9 h^2
    assert zero["reduce_bucket_size"] == 256 * 256 and zero["stage3_prefetch_bucket_size"] == 256 * 1024
    assert zero["stage3_param_persistence_threshold"] == 2560
    config = deepspeed_config(recipe, 32)
    assert config["communication_data_type"] == "fp32" and config["data_types"] == {"grad_accum_dtype": "fp32"}
    one_node = deepspeed_config(load_recipe(R70, ["cluster.nodes=1", "train.global_batch_size=16",
                                                  "train.micro_batch_size=1", "train.grad_accum=2"]), 8)
    assert "zero_hpz_partition_size" not in one_node["zero_optimization"]
    z0 = deepspeed_config(load_recipe(R70, ["deepspeed.zero_stage=0"]), 32)
    assert z0["zero_optimization"] == {"stage": 0} and "data_types" not in z0
    custom = deepspeed_config(load_recipe(R70, ["deepspeed.overrides={zero_optimization: {overlap_comm: false}}"]), 32)
    assert custom["zero_optimization"]["overlap_comm"] is False


def test_ring_split_and_gpu_peaks():
    c = step_model.Collective("x", 800.0, nodes=4, per_node=8)
    assert (c.net, c.nvl) == (100.0, 700.0)
    hw = step_model.Hardware(nic_gbps=400, nics_per_node=8, nvlink_gbps=2880, gpus_per_node=8)
    assert c.net_s(hw) == pytest.approx(100 * 8 / 400e9) and c.nvl_s(hw) == pytest.approx(700 / 360e9)
    one = step_model.Collective("y", 800.0, nodes=8, per_node=1)  # one rank per node: every hop over the network
    assert one.net == 800.0 and one.net_s(hw) == pytest.approx(800 / 50e9)
    assert step_model.Collective("z", 800.0, nodes=1, per_node=8).net == 0
    assert step_model.peak_tflops("NVIDIA H100 80GB HBM3") == 989 and step_model.peak_tflops("NVIDIA H100 PCIe") == 756
    assert step_model.peak_tflops("NVIDIA A100-SXM4-80GB") == 312 and step_model.peak_tflops("NVIDIA A100-SXM4-80GB", "float32") == 156
    assert step_model.peak_tflops("NVIDIA GH200 480GB") == 989 and step_model.peak_tflops("NVIDIA B200") == 2250
    assert step_model.peak_tflops("cpu") is None
    assert step_model.ring_bytes("all_reduce", 100, 4) == 150 and step_model.ring_bytes("all_gather", 100, 1) == 0


def test_row_tokens_come_from_the_shards(tmp_path):
    """The plan's rows are the data's: their lengths read from the shards (the Parquet offsets), the peak
    the longest when every row was read; data.seq_len pads every row; --seq-len replaces them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    recipe = load_recipe(R70, [f"data.train={tmp_path}"])
    assert "ASSUMED" in step_model.row_tokens(recipe).note and step_model.row_tokens(recipe).mean == 1024
    lengths = [100] * 30 + [400] * 10  # mean 175
    pq.write_table(pa.table({"input_ids": [[1] * n for n in lengths]}), tmp_path / "shard-00000.parquet",
                   row_group_size=8)
    (tmp_path / "manifest.json").write_text(json.dumps(
        {"shards": [{"file": "shard-00000.parquet"}], "config": {"tokenize": {"max_length": 1024}, "shards": {}}}))
    rows = step_model.row_tokens(recipe)
    assert (rows.mean, rows.peak) == (175, 400) and "from the shards" in rows.note and rows.bucketing
    assert sorted(rows.lengths.tolist()) == sorted(lengths)
    assert step_model.row_tokens(recipe, seq_len=512).mean == 512
    padded = step_model.row_tokens(load_recipe(R70, [f"data.train={tmp_path}", "data.seq_len=512"]))
    assert padded.peak == 512 and padded.deal(2, 1, 32).padding_ratio == pytest.approx(512 / 175)
    rep = validate.validate_recipe(R70, [f"data.train={tmp_path}"], offline=True, recommend=False)
    five = validate.validate_recipe(R70, [f"data.train={tmp_path}"], offline=True, seq_len=1024, recommend=False)
    assert rep.numbers["step_flops"] < five.numbers["step_flops"] / 4  # short rows, not 1024
    # with the build's per-shard statistics the peak is their longest row, read or not (a sample may miss it)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["shards"][0]["stats"] = {"tokens_max": {"value": 700, "row": 0}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert step_model.row_tokens(recipe).peak == 700


def test_weights_load_onto_the_gpu_below_zero3_without_tp():
    import torch

    from recipes.engines.deepspeed.runtime.model import load_placement

    gpu = torch.device("cuda", 3)
    recipe = load_recipe(R70, ["deepspeed.zero_stage=2"])
    assert load_placement(recipe, gpu) == {"device_map": {"": gpu}}
    assert load_placement(recipe, torch.device("cpu")) == {}
    assert load_placement(load_recipe(R70), gpu) == {}  # ZeRO-3: partitioned by HfDeepSpeedConfig
    assert load_placement(load_recipe(R70, ["deepspeed.zero_stage=2", "deepspeed.tp_size=8", "loss.head=logits",
                                            "train.global_batch_size=8"]), gpu) == {}
