"""HF <-> Megatron conversion (recipes/engines/megatron/runtime/convert.py), in one process: the QKV interleave on
hand-made tensors, the bit-exact round trip at TP 1 and 2 (x PP 1, 2 and 2 x VP 2) for a tied Llama and
an untied Qwen2 with QKV bias, shapes and padding, TE names, the TransformerConfig, RoPE, refusals, and
that a pipeline stage reads only the shards it needs and a TP rank only its slices (at a 128k vocabulary
too, with its peak memory). Logits are checked in test_model.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from recipes.engines.megatron.runtime.convert import (
    SafetensorsReader,
    global_layer_names,
    gpt_model_kwargs,
    hf_to_megatron,
    interleave_qkv,
    layer_range,
    megatron_to_hf,
    padded_vocab_size,
    rope_inv_freq,
    split_qkv,
    te_name,
    transformer_config_from_hf,
)
from tests.recipes.engines.megatron.helpers import VOCAB, save_tiny


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {kind: save_tiny(kind, root / kind) for kind in ("llama", "qwen2")}


def _hf_config(path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path))


def test_qkv_interleave_hand_made():
    # 4 query heads in 2 groups, head dim 2, hidden 1: every row names its head
    d = 2
    q = torch.tensor([[10.0], [11.0], [20.0], [21.0], [30.0], [31.0], [40.0], [41.0]])  # heads 1..4
    k = torch.tensor([[-1.0], [-1.1], [-2.0], [-2.1]])  # kv heads 1, 2
    v = torch.tensor([[100.0], [100.1], [200.0], [200.1]])
    qkv = interleave_qkv(q, k, v, groups=2)
    # group 1: q heads 1, 2, then k head 1, v head 1; group 2: q heads 3, 4, k head 2, v head 2
    expected = [10, 11, 20, 21, -1, -1.1, 100, 100.1, 30, 31, 40, 41, -2, -2.1, 200, 200.1]
    assert qkv[:, 0].tolist() == pytest.approx(expected)
    # TP 2 takes one group each: rank 1 must hold heads 3, 4 and kv head 2 only
    assert qkv.chunk(2)[1][:, 0].tolist() == pytest.approx(expected[8:])
    back = split_qkv(qkv, groups=2, heads=4, d=d)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))
    bias = interleave_qkv(q[:, 0], k[:, 0], v[:, 0], groups=2)  # 1-D (Qwen2's bias)
    assert bias.tolist() == pytest.approx(expected)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("tp,pp,vp", [(1, 1, None), (2, 1, None), (2, 2, None), (1, 2, 2)])
def test_round_trip_bit_exact(checkpoints, kind, tp, pp, vp):
    if kind == "qwen2" and vp:
        pytest.skip("the Qwen2 has 2 layers: no PP 2 x VP 2")
    path = checkpoints[kind]
    hf_config = _hf_config(path)
    reader = SafetensorsReader(path)
    hf = {k: reader(k) for k in reader}
    config = transformer_config_from_hf(hf_config, tp_size=tp, pp_size=pp, virtual_pp_size=vp)
    padded = padded_vocab_size(VOCAB, tp)
    assert padded == 128 * tp * -(-VOCAB // (128 * tp))
    gathered: dict[str, list] = {}
    for pp_rank in range(pp):
        for vp_stage in ([None] if vp is None else range(vp)):
            offset = layer_range(config, pp_rank, vp_stage).start
            for tp_rank in range(tp):
                state = hf_to_megatron(hf.__getitem__, config, hf_config, tp_rank=tp_rank, tp_size=tp,
                                       pp_rank=pp_rank, pp_size=pp, vp_stage=vp_stage)
                emb = state.get("embedding.word_embeddings.weight")
                if emb is not None:
                    assert emb.shape == (padded // tp, 64)
                    start = tp_rank * padded // tp
                    real = max(0, min(padded // tp, VOCAB - start))
                    assert torch.equal(emb[:real], hf["model.embed_tokens.weight"][start:start + real])
                    assert (emb[real:] == 0).all()  # vocabulary padding: zero rows
                qkv = state["decoder.layers.0.self_attention.linear_qkv.weight"]
                assert qkv.shape == ((2 // tp) * (2 + 2) * 16, 64)  # groups/tp x (2 q + k + v) x head dim
                assert state["decoder.layers.0.mlp.linear_fc1.weight"].shape[0] == 2 * hf_config.intermediate_size // tp
                assert ("decoder.layers.0.self_attention.linear_qkv.bias" in state) == (kind == "qwen2")
                last = pp_rank == pp - 1 and vp_stage in (None, (vp or 1) - 1)
                if kind == "llama" and last and pp > 1:  # tied, PP > 1: the last stage's copy
                    assert torch.equal(state["output_layer.weight"],
                                       torch.cat([hf["model.embed_tokens.weight"],
                                                  torch.zeros(padded - VOCAB, 64)]).chunk(tp)[tp_rank])
                if kind == "llama" and pp == 1:
                    assert "output_layer.weight" not in state  # tied, one stage: the embedding is the head
                for name, t in global_layer_names(state, offset).items():
                    gathered.setdefault(name, []).append(t)
    back = megatron_to_hf(gathered, config, hf_config)
    assert sorted(back) == sorted(hf)  # a tied model has no lm_head.weight in the checkpoint either
    for name, t in hf.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_te_spec_state_is_the_local_one_renamed_and_exports_bit_exact(checkpoints, tp, pp):
    """The Transformer Engine spec's state dict is the local spec's under `te_name` (the two norms move
    into linear_qkv / linear_fc1 as `layer_norm_weight`), the same tensors bit for bit, on every (TP, PP)
    rank; exported back from the TE names it is the HF checkpoint bit for bit."""
    path = checkpoints["qwen2"]
    hf_config, reader = _hf_config(path), SafetensorsReader(path)
    config = transformer_config_from_hf(hf_config, tp_size=tp, pp_size=pp)
    gathered: dict[str, list] = {}
    for pp_rank in range(pp):
        offset = layer_range(config, pp_rank).start
        for tp_rank in range(tp):
            where = {"tp_rank": tp_rank, "tp_size": tp, "pp_rank": pp_rank, "pp_size": pp}
            local = hf_to_megatron(reader, config, hf_config, **where)
            te = hf_to_megatron(reader, config, hf_config, te_names=True, **where)
            assert {te_name(k) for k in local} == set(te) and len(te) == len(local)
            assert all(torch.equal(te[te_name(k)], v) for k, v in local.items())
            layer = "decoder.layers.0."
            fused_norms = {layer + "self_attention.linear_qkv.layer_norm_weight", layer + "mlp.linear_fc1.layer_norm_weight"}
            assert fused_norms <= set(te)
            assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in te)
            for name, t in global_layer_names(te, offset).items():
                gathered.setdefault(name, []).append(t)
    back = megatron_to_hf(gathered, config, hf_config)
    assert sorted(back) == sorted(reader.keys())
    assert all(torch.equal(back[k], reader(k)) for k in back)


def test_stage_reads_only_its_shards(checkpoints):
    path = checkpoints["llama"]
    hf_config = _hf_config(path)
    config = transformer_config_from_hf(hf_config, tp_size=1, pp_size=2)
    reader = SafetensorsReader(path)
    assert len(set(reader.weight_map.values())) > 3  # the fixture is really sharded
    state = hf_to_megatron(reader, config, hf_config, tp_rank=0, tp_size=1, pp_rank=1, pp_size=2)
    needed = {reader.weight_map[k] for k in reader
              if k.startswith(("model.layers.2.", "model.layers.3.", "model.norm.", "model.embed_tokens."))}
    assert reader.files_opened == needed
    assert not any(reader.weight_map[k] in reader.files_opened for k in reader
                   if k.startswith("model.layers.0.") and reader.weight_map[k] not in needed)
    assert "decoder.layers.1.mlp.linear_fc2.weight" in state and "decoder.layers.2.mlp.linear_fc2.weight" not in state


def test_transformer_config(checkpoints):
    llama, qwen = _hf_config(checkpoints["llama"]), _hf_config(checkpoints["qwen2"])
    c = transformer_config_from_hf(qwen, tp_size=2, pp_size=1, sequence_parallel=True, recompute="full")
    assert (c.num_layers, c.hidden_size, c.num_attention_heads, c.num_query_groups, c.kv_channels,
            c.ffn_hidden_size) == (2, 64, 4, 2, 16, 96)
    assert c.add_qkv_bias and not c.add_bias_linear and c.gated_linear_unit and c.normalization == "RMSNorm"
    assert c.layernorm_epsilon == qwen.rms_norm_eps and c.sequence_parallel
    assert c.recompute_granularity == "full" and c.activation_func is torch.nn.functional.silu
    c = transformer_config_from_hf(llama, dtype=torch.bfloat16)
    assert not c.add_qkv_bias and c.bf16 and c.params_dtype == torch.bfloat16
    kw = gpt_model_kwargs(llama, tp_size=2)
    assert kw["vocab_size"] == 512 and kw["share_embeddings_and_output_weights"] and kw["rotary_base"] == 500000.0
    assert not gpt_model_kwargs(qwen, tp_size=1)["share_embeddings_and_output_weights"]
    with pytest.raises(ValueError, match="KV heads"):
        transformer_config_from_hf(llama, tp_size=4)


def test_rope_matches_hf_and_unknown_kinds_are_refused(checkpoints):
    from transformers import AutoConfig, AutoModelForCausalLM

    llama = _hf_config(checkpoints["llama"])
    hf_inv = AutoModelForCausalLM.from_config(llama).model.rotary_emb.inv_freq
    ours = rope_inv_freq(llama, 16)
    assert torch.equal(ours, hf_inv.float())
    plain = rope_inv_freq(AutoConfig.for_model("llama", hidden_size=64, num_attention_heads=4), 16)
    assert not torch.equal(ours, plain)  # the scaling really changes the frequencies here
    dynamic = AutoConfig.for_model("llama", hidden_size=64, num_attention_heads=4,
                                   rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    with pytest.raises(NotImplementedError, match="dynamic"):  # every kind: test_qwen3.py
        transformer_config_from_hf(dynamic)
    mistral = AutoConfig.for_model("mistral", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   sliding_window=16, max_position_embeddings=64)
    with pytest.raises(NotImplementedError, match="sliding_window"):
        transformer_config_from_hf(mistral)
    mistral.sliding_window = None
    assert transformer_config_from_hf(mistral).num_query_groups == 2
    with pytest.raises(NotImplementedError, match="model_type"):
        transformer_config_from_hf(AutoConfig.for_model("gpt2"))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_rank_reads_only_its_tp_slices_and_gets_the_whole_tensor_conversion(checkpoints, kind):
    """From a reader, each (TP, PP) rank converts bit for bit what cutting the whole tensors gives, and
    reads exactly the bytes of what it holds: no row of another rank, no padding row."""
    path = checkpoints[kind]
    hf_config = _hf_config(path)
    config = transformer_config_from_hf(hf_config, tp_size=2, pp_size=2)
    everything = SafetensorsReader(path)
    hf = {k: everything(k) for k in everything}
    step = padded_vocab_size(VOCAB, 2) // 2
    for pp_rank in range(2):
        for tp_rank in range(2):
            where = {"tp_rank": tp_rank, "tp_size": 2, "pp_rank": pp_rank, "pp_size": 2}
            reader = SafetensorsReader(path)
            sliced = hf_to_megatron(reader, config, hf_config, **where)
            whole = hf_to_megatron(hf.__getitem__, config, hf_config, **where)
            assert sorted(sliced) == sorted(whole)
            assert all(torch.equal(sliced[k], whole[k]) for k in whole), (pp_rank, tp_rank)
            padding_rows = step - max(0, min(step, VOCAB - tp_rank * step))
            vocab = [k for k in sliced if k.endswith(("word_embeddings.weight", "output_layer.weight"))]
            held = sum(t.numel() * t.element_size() for t in sliced.values())
            pad = sum(padding_rows * sliced[k].shape[1] * sliced[k].element_size() for k in vocab)
            assert reader.bytes_read == held - pad, (pp_rank, tp_rank)


REAL_SIZE = """
import json, resource, sys, torch
from transformers import AutoConfig
from recipes.engines.megatron.runtime.convert import SafetensorsReader, hf_to_megatron, transformer_config_from_hf
path = sys.argv[1]
hf_config = AutoConfig.from_pretrained(path)
config = transformer_config_from_hf(hf_config, tp_size=8, dtype=torch.bfloat16)
reader = SafetensorsReader(path)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
state = hf_to_megatron(reader, config, hf_config, tp_rank=7, tp_size=8, pp_rank=0, pp_size=1)
added = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"rss_added": added * 1024, "bytes_read": reader.bytes_read,
                  "vocab_shape": list(state["embedding.word_embeddings.weight"].shape)}))
"""


def test_a_tp8_rank_of_a_128k_vocabulary_never_holds_the_whole_embedding(tmp_path):
    """At a Llama-3 vocabulary (128,256 rows, H 1024, bf16: 263 MB per vocab matrix, untied) TP rank 7 of
    8 reads its 1/8 of the embedding and of lm_head, and its peak memory grows by less than one whole
    matrix (reading the whole and padding it, as a rank once did, adds at least two)."""
    import json
    import subprocess
    import sys

    from safetensors.torch import save_file
    from transformers import LlamaConfig

    vocab, hidden = 128_256, 1024
    hf_config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=256, num_hidden_layers=1,
                            num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False)
    hf_config.save_pretrained(str(tmp_path))
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
              "model.norm.weight": (hidden,), "model.layers.0.input_layernorm.weight": (hidden,),
              "model.layers.0.post_attention_layernorm.weight": (hidden,),
              **{f"model.layers.0.self_attn.{p}_proj.weight": (hidden, hidden) for p in "qkvo"},
              "model.layers.0.mlp.gate_proj.weight": (256, hidden), "model.layers.0.mlp.up_proj.weight": (256, hidden),
              "model.layers.0.mlp.down_proj.weight": (hidden, 256)}
    save_file({k: torch.randn(s, generator=g).to(torch.bfloat16) for k, s in shapes.items()},
              str(tmp_path / "model.safetensors"))
    matrix = vocab * hidden * 2
    done = subprocess.run([sys.executable, "-c", REAL_SIZE, str(tmp_path)], capture_output=True, text=True, check=False,
                          timeout=300, cwd=str(Path(__file__).resolve().parents[5]))
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    padded = padded_vocab_size(vocab, 8)
    assert got["vocab_shape"] == [padded // 8, hidden]
    real_rows = vocab - 7 * (padded // 8)  # the last rank holds the padding rows
    layer = (4 * hidden * hidden + 3 * 256 * hidden) // 8 * 2 + 2 * hidden * 2  # its eighth of each matrix, both norms
    assert got["bytes_read"] == 2 * real_rows * hidden * 2 + layer + hidden * 2
    assert got["rss_added"] < matrix, f"{got['rss_added'] / 2**20:.0f} MiB added, one matrix is {matrix / 2**20:.0f}"
