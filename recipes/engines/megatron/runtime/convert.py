"""Hugging Face Llama-family checkpoints <-> megatron-core GPTModel state dicts (our own conversion).

Which backbones convert (llama, qwen2, mistral, qwen3, and the mixture-of-experts qwen3_moe and mixtral) is
decided from their config alone in `support.py` (`check_supported`); the router and experts' names and expert
parallelism are `moe.py`'s, RoPE's frequencies `rope.py`'s.

Megatron's layout of a decoder layer, per tensor-parallel (TP) rank r of T:
- `linear_qkv.weight` `[(G/T)·(q+2)·d, H]`: the query groups g of rank r, each as `[q_g; k_g; v_g]`
  (the q = heads/groups query heads of the group, then its key head, then its value head; d = head
  dim). The bias (Qwen2) follows the same order. G must divide by T.
- `linear_proj.weight` `[H, heads·d/T]`: o_proj's columns of rank r's heads (row-parallel).
- `linear_fc1.weight` `[2·F/T, H]`: `[gate_r; up_r]`, rank r's rows of gate_proj then of up_proj.
- `linear_fc2.weight` `[H, F/T]`: down_proj's columns of rank r (row-parallel).
- `q_layernorm.weight`, `k_layernorm.weight` `[d]` (Qwen3's `q_norm` / `k_norm`, megatron's `qk_layernorm`):
  replicated, the same name under both specs; applied per head, so each TP rank's gradient covers its own
  heads only and megatron's `finalize_model_grads` sums them over TP (whenever `qk_layernorm` is set).
- MoE layers (`moe.py`): `mlp.router.weight` replicated, and per local expert j of the EP rank
  `mlp.experts.local_experts.j.linear_fc1.weight` / `linear_fc2.weight`, TP-split as fc1 / fc2 above.
- norms: replicated. With the Transformer Engine spec the input norm lives in
  `self_attention.linear_qkv.layer_norm_weight` and the pre-MLP norm in `mlp.linear_fc1.layer_norm_weight`
  (`te_names=True`); the local spec keeps `input_layernorm.weight` / `pre_mlp_layernorm.weight`.
- `embedding.word_embeddings.weight` and `output_layer.weight`: `[V'/T, H]`, rows of the vocabulary
  padded to V' (a multiple of `make_vocab_size_divisible_by · T`, Megatron's rule) with zero rows.
  With tied embeddings, a single pipeline stage holds only the embedding (the output layer reads it);
  with PP > 1 the last stage holds a copy as `output_layer.weight`, which must get the same values.

Pipeline: rank p's model chunk v (`vp_stage`) holds decoder layers `offset .. offset+n-1` under the
local names `decoder.layers.0 .. n-1` (offset and n from megatron's own layer split); the first chunk
of the first stage has the embedding, the last chunk of the last stage the final norm and output layer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from . import moe
from ..pure.kernels import FUSION_FLAGS, NO_FUSIONS
from .rope import attention_score_scale, rope_inv_freq  # noqa: F401  (rope_inv_freq: model.py)
from ..pure.support import QKV_BIAS_TYPES, check_supported, head_dim, qk_norm, rope_settings
DEFAULT_VOCAB_DIVISOR = 128  # Megatron-LM's --make-vocab-size-divisible-by default
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# the two norms fused into TE's linear layers: local-spec suffix -> TE-spec suffix (megatron's local spec
# saves its norms under these names too: its `sharded_state_dict_keys_map`)
_TE_NORMS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
             "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
# Qwen3's per-head q / k norms: HF layer suffix -> megatron layer suffix (the same under the TE spec, whose
# TENorm is a separate module there too)
_QK_NORMS = {"self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
             "self_attn.k_norm.weight": "self_attention.k_layernorm.weight"}


def te_name(name: str) -> str:
    """A local-spec parameter name under the Transformer Engine spec: the two per-layer norms move into
    the linear layers they are fused with; every other name is the same."""
    m = _LAYER.match(name)
    if m is None or m.group(2) not in _TE_NORMS:
        return name
    return f"decoder.layers.{m.group(1)}.{_TE_NORMS[m.group(2)]}"


# ---- configuration -----------------------------------------------------------------------------------


def padded_vocab_size(vocab_size: int, tp_size: int, divisible_by: int = DEFAULT_VOCAB_DIVISOR) -> int:
    """Megatron's padded vocabulary: the next multiple of `divisible_by · tp_size`."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def transformer_config_from_hf(hf_config, *, tp_size: int = 1, pp_size: int = 1,
                               virtual_pp_size: int | None = None, sequence_parallel: bool = False,
                               dtype: torch.dtype = torch.float32, recompute: str | None = None,
                               perform_initialization: bool = True, use_cpu_initialization: bool | None = None,
                               fusions: Mapping[str, bool] | None = None, ep_size: int = 1,
                               moe_token_dispatcher: str = "auto", router_aux_coeff: float | None = None):
    """A megatron-core `TransformerConfig` for an HF Llama / Qwen2 / Mistral / Qwen3 / Qwen3-MoE / Mixtral
    config and a layout. MoE: `ep_size`, the token dispatcher and the router loss's weight
    (`moe.moe_config_kwargs`: dropless, EP must divide the experts, TP > 1 needs SP).

    No dropout (fine-tuning), fp32 softmax. `fusions`: the fused kernels to use, TransformerConfig field ->
    bool (`kernels.KernelPlan.fusions`); every one left out is off (default: all off, plain torch ops).
    `perform_initialization=False` skips the random init when weights are loaded right after (large models
    build faster). Pure: no communication. RoPE and the vocabulary are GPTModel arguments: see
    `gpt_model_kwargs`."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    unknown = set(fusions or {}) - set(FUSION_FLAGS)
    if unknown:
        raise ValueError(f"fusions: unknown flags {sorted(unknown)}; known: {list(FUSION_FLAGS)}")

    check_supported(hf_config)
    groups = hf_config.num_key_value_heads or hf_config.num_attention_heads
    if groups % tp_size:
        raise ValueError(f"megatron.tp_size {tp_size}: the model's {groups} KV heads (query groups) must divide by it")
    if hf_config.num_hidden_layers % (pp_size * (virtual_pp_size or 1)):
        raise ValueError(f"{hf_config.num_hidden_layers} layers do not split evenly over pp_size {pp_size} x "
                         f"virtual_pp_size {virtual_pp_size or 1}")
    recompute_args = {}
    if recompute == "full":
        recompute_args = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    elif recompute == "selective":
        recompute_args = {"recompute_granularity": "selective"}
    elif recompute is not None:
        raise ValueError(f"recompute {recompute!r}: expected None, 'full' or 'selective'")
    d = head_dim(hf_config)
    moe_args = moe.moe_config_kwargs(hf_config, ep_size=ep_size, tp_size=tp_size,
                                     sequence_parallel=sequence_parallel and tp_size > 1,
                                     dispatcher=moe_token_dispatcher, router_aux_coeff=router_aux_coeff)
    return TransformerConfig(
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads, num_query_groups=groups, kv_channels=d,
        ffn_hidden_size=hf_config.intermediate_size, normalization="RMSNorm", layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=hf_config.model_type in QKV_BIAS_TYPES, qk_layernorm=qk_norm(hf_config),
        softmax_scale=attention_score_scale(hf_config, d),  # None but for YaRN (rope.py)
        hidden_dropout=0.0, attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0) or 0.0),
        init_method_std=getattr(hf_config, "initializer_range", 0.02),
        tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=pp_size,
        virtual_pipeline_model_parallel_size=virtual_pp_size, sequence_parallel=sequence_parallel and tp_size > 1,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, pipeline_dtype=dtype,
        **{**NO_FUSIONS, **(fusions or {})}, attention_softmax_in_fp32=True, apply_query_key_layer_scaling=False,
        use_cpu_initialization=(not torch.cuda.is_available()) if use_cpu_initialization is None else use_cpu_initialization,
        perform_initialization=perform_initialization, **recompute_args, **moe_args)


def gpt_model_kwargs(hf_config, tp_size: int, divisible_by: int = DEFAULT_VOCAB_DIVISOR) -> dict:
    """The GPTModel constructor arguments that come from the HF config: padded vocabulary, positions,
    RoPE base (scaling is written into the built model: see `rope_inv_freq`), tied embeddings."""
    theta, _ = rope_settings(hf_config)
    return {"vocab_size": padded_vocab_size(hf_config.vocab_size, tp_size, divisible_by),
                "max_sequence_length": hf_config.max_position_embeddings, "position_embedding_type": "rope",
                "rotary_base": theta, "rotary_percent": 1.0,
                "share_embeddings_and_output_weights": bool(getattr(hf_config, "tie_word_embeddings", False))}


# ---- reading a HF checkpoint ---------------------------------------------------------------------------


class SafetensorsReader:
    """`reader(name) -> Tensor` over an HF safetensors directory (sharded with its index, or a single
    `model.safetensors`). Opens a shard only when a tensor in it is asked for (the index's `weight_map`
    says which), reads that tensor alone (safetensors memory-maps), so a rank reads only its stage's
    share; `read_range` reads one TP rank's slice of a tensor and nothing else (at 70B, TP 8, a full
    bf16 embedding is 2.1 GB per rank where the slice is 0.26 GB). `files_opened` and `bytes_read`
    record what was read; `bytes_read_in_process` what every reader of this process read (a resume or a
    start from a conversion reads none)."""

    bytes_read_in_process = 0

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        else:
            from safetensors import safe_open

            single = self.path / "model.safetensors"
            if not single.is_file():
                raise FileNotFoundError(f"{self.path}: neither model.safetensors.index.json nor model.safetensors")
            with safe_open(str(single), framework="pt") as f:
                self.weight_map = {k: single.name for k in f.keys()}  # safe_open is not iterable
        self.files_opened: set[str] = set()
        self.bytes_read = 0  # of the tensors returned: what a rank pulled from disk (page cache aside)
        self._open: dict = {}

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def __iter__(self):
        return iter(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _file(self, name: str):
        from safetensors import safe_open

        if name not in self.weight_map:
            raise KeyError(f"{self.path}: no tensor {name!r} in the checkpoint")
        file = self.weight_map[name]
        if file not in self._open:
            self._open[file] = safe_open(str(self.path / file), framework="pt")
            self.files_opened.add(file)
        return self._open[file]

    def _counted(self, t: torch.Tensor) -> torch.Tensor:
        self.bytes_read += t.numel() * t.element_size()
        SafetensorsReader.bytes_read_in_process += t.numel() * t.element_size()
        return t

    def __call__(self, name: str) -> torch.Tensor:
        return self._counted(self._file(name).get_tensor(name))

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file(name).get_slice(name).get_shape())

    def read_range(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """`tensor.narrow(dim, start, stop - start)` reading only those elements from the file."""
        index = (slice(None),) * dim + (slice(start, stop),)
        return self._counted(self._file(name).get_slice(name)[index])


class WholeTensors:
    """The `SafetensorsReader` interface over any `name -> Tensor` callable (a dict's `__getitem__`, a
    test's gradients): each range is cut from the whole tensor, which is what a reader avoids."""

    def __init__(self, get_tensor: Callable[[str], torch.Tensor]):
        self.get_tensor = get_tensor

    def __call__(self, name: str) -> torch.Tensor:
        return self.get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.get_tensor(name).shape)

    def read_range(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        return self.get_tensor(name).narrow(dim, start, stop - start).clone()  # a copy: the whole can go


# ---- HF -> Megatron -------------------------------------------------------------------------------------


def layer_range(config, pp_rank: int, vp_stage: int | None = None) -> range:
    """Global decoder layers of pipeline rank `pp_rank`'s chunk `vp_stage` (megatron's own split)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank))


def stage_ends(config, pp_rank: int, vp_stage: int | None = None) -> tuple[bool, bool]:
    """(pre_process, post_process) of a model chunk: the first chunk of the first stage holds the
    embedding, the last chunk of the last stage the final norm and output layer."""
    vp = config.virtual_pipeline_model_parallel_size or 1
    v = vp_stage or 0
    return pp_rank == 0 and v == 0, pp_rank == config.pipeline_model_parallel_size - 1 and v == vp - 1


def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """HF q `[heads·d, ...]`, k and v `[groups·d, ...]` -> Megatron's `[G·(q+2)·d, ...]` in group order
    (`[q_g; k_g; v_g]` per group g); a bias (1-D) or a weight (2-D)."""
    rest = q.shape[1:]
    per_group = q.view(groups, -1, *rest), k.view(groups, -1, *rest), v.view(groups, -1, *rest)
    return torch.cat(per_group, dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, groups: int, heads: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `interleave_qkv`: Megatron's `[G·(q+2)·d, ...]` -> HF (q, k, v)."""
    rest = qkv.shape[1:]
    per_group = qkv.reshape(groups, (heads // groups + 2) * d, *rest)
    q, k, v = per_group.split([heads // groups * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _tp_slice(source, name: str, rank: int, size: int, dim: int = 0) -> torch.Tensor:
    """TP rank `rank`'s equal share of `name` along `dim`, read alone."""
    n = source.shape(name)[dim]
    if n % size:
        raise ValueError(f"{name}: dimension {dim} of size {n} does not split over {size} tensor-parallel ranks")
    step = n // size
    return source.read_range(name, dim, rank * step, (rank + 1) * step)


def _vocab_slice(source, name: str, rank: int, size: int, padded: int) -> torch.Tensor:
    """TP rank `rank`'s rows of `name` zero-padded to `padded` rows; only the real rows it holds are read."""
    rows = source.shape(name)[0]
    if rows > padded:
        raise ValueError(f"vocabulary of {rows} rows is larger than the padded size {padded}")
    step = padded // size
    start, stop = min(rank * step, rows), min((rank + 1) * step, rows)
    real = source.read_range(name, 0, start, stop)
    return torch.cat([real, real.new_zeros(step - real.shape[0], *real.shape[1:])])


def hf_to_megatron(get_tensor: Callable[[str], torch.Tensor], config, hf_config, *, tp_rank: int, tp_size: int,
                   pp_rank: int, pp_size: int, vp_stage: int | None = None, te_names: bool = False,
                   divisible_by: int = DEFAULT_VOCAB_DIVISOR, ep_rank: int = 0) -> dict[str, torch.Tensor]:
    """This rank's GPTModel state dict (one model chunk: `vp_stage`) from an HF checkpoint.

    Parallel contract: no communication; each rank calls it for itself and reads (through `get_tensor`:
    a `SafetensorsReader`, or any `name -> Tensor` callable) only the HF tensors of its own layers, plus
    the embedding (first stage) and the final norm and lm_head (last stage); from a reader, only its
    TP slice of each split tensor (`read_range`), so a rank's reads are its share of the stage. Returns
    tensors in `config.params_dtype`, local layer names (`decoder.layers.0` is the chunk's first layer),
    `te_names` for the Transformer Engine spec.
    Tied embeddings: the last stage's `output_layer.weight` is the (padded) embedding shard too.
    MoE: `ep_rank` of `config.expert_model_parallel_size` reads and holds its experts only (`moe.py`);
    under the TE spec an MoE layer's pre-MLP norm keeps its own name (nothing to fuse it into)."""
    if (config.tensor_model_parallel_size, config.pipeline_model_parallel_size) != (tp_size, pp_size):
        raise ValueError(f"config is TP {config.tensor_model_parallel_size} x PP {config.pipeline_model_parallel_size},"
                         f" asked for TP {tp_size} x PP {pp_size}")
    dtype = config.params_dtype
    groups = config.num_query_groups
    if groups % tp_size:
        raise ValueError(f"{groups} query groups do not split over {tp_size} tensor-parallel ranks")
    source = get_tensor if hasattr(get_tensor, "read_range") else WholeTensors(get_tensor)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    padded = padded_vocab_size(hf_config.vocab_size, tp_size, divisible_by)
    pre, post = stage_ends(config, pp_rank, vp_stage)
    out: dict[str, torch.Tensor] = {}

    def put(name: str, tensor: torch.Tensor) -> None:
        out[name] = tensor.to(dtype).contiguous()

    if pre:
        put("embedding.word_embeddings.weight", _vocab_slice(source, "model.embed_tokens.weight", tp_rank, tp_size,
                                                             padded))
    for local, layer in enumerate(layer_range(config, pp_rank, vp_stage)):
        hf, mg = f"model.layers.{layer}.", f"decoder.layers.{local}."
        norm_in, norm_mlp = ("input_layernorm.weight", "pre_mlp_layernorm.weight")
        if te_names:
            norm_in = _TE_NORMS[norm_in]  # `te_name`
            norm_mlp = norm_mlp if config.num_moe_experts else _TE_NORMS[norm_mlp]
        put(mg + norm_in, source(hf + "input_layernorm.weight"))
        put(mg + norm_mlp, source(hf + "post_attention_layernorm.weight"))
        for kind in ("weight", "bias") if config.add_qkv_bias else ("weight",):
            # q, k and v each split into T equal row blocks hold the same G/T query groups: rank r's
            # groups interleave from its own blocks, nothing else read
            q, k, v = (_tp_slice(source, hf + f"self_attn.{p}_proj.{kind}", tp_rank, tp_size) for p in "qkv")
            put(mg + f"self_attention.linear_qkv.{kind}", interleave_qkv(q, k, v, groups // tp_size))
        if config.qk_layernorm:
            for hf_norm, mg_norm in _QK_NORMS.items():
                put(mg + mg_norm, source(hf + hf_norm))
        put(mg + "self_attention.linear_proj.weight", _tp_slice(source, hf + "self_attn.o_proj.weight", tp_rank,
                                                                tp_size, dim=1))
        if config.num_moe_experts:
            router, experts = moe.hf_moe_names(hf_config, layer)
            put(mg + "mlp.router.weight", source(router))
            ep = config.expert_model_parallel_size
            for j, e in enumerate(moe.local_expert_range(config.num_moe_experts, ep_rank, ep)):
                gate_name, up_name, down_name = experts[e]
                gate, up = (_tp_slice(source, n, tp_rank, tp_size) for n in (gate_name, up_name))
                put(mg + f"mlp.experts.local_experts.{j}.linear_fc1.weight", torch.cat([gate, up]))
                put(mg + f"mlp.experts.local_experts.{j}.linear_fc2.weight",
                    _tp_slice(source, down_name, tp_rank, tp_size, dim=1))
            continue
        gate, up = (_tp_slice(source, hf + f"mlp.{p}_proj.weight", tp_rank, tp_size) for p in ("gate", "up"))
        put(mg + "mlp.linear_fc1.weight", torch.cat([gate, up]))
        put(mg + "mlp.linear_fc2.weight", _tp_slice(source, hf + "mlp.down_proj.weight", tp_rank, tp_size, dim=1))
    if post:
        put("decoder.final_layernorm.weight", source("model.norm.weight"))
        if not tied:
            put("output_layer.weight", _vocab_slice(source, "lm_head.weight", tp_rank, tp_size, padded))
        elif not pre:  # PP > 1, tied: the last stage's copy of the embedding
            put("output_layer.weight", _vocab_slice(source, "model.embed_tokens.weight", tp_rank, tp_size, padded))
    return out


# ---- Megatron -> HF -------------------------------------------------------------------------------------


_MG_QK_NORMS = {mg: hf for hf, mg in _QK_NORMS.items()}


def tp_split_dim(name: str) -> int | None:
    """The dimension a Megatron tensor is split along over TP: 0 (column-parallel: qkv, fc1, vocab),
    1 (row-parallel: proj, fc2), None (replicated: norms)."""
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "word_embeddings.weight",
                      "output_layer.weight")):
        return 0
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return None


def global_layer_names(state: Mapping[str, object], offset: int) -> dict[str, object]:
    """`decoder.layers.<local>.x` -> `decoder.layers.<offset+local>.x` (other names unchanged)."""
    out = {}
    for name, value in state.items():
        m = _LAYER.match(name)
        out[f"decoder.layers.{int(m.group(1)) + offset}.{m.group(2)}" if m else name] = value
    return out


def megatron_to_hf(shards: Mapping[str, Sequence[torch.Tensor] | torch.Tensor], config, hf_config
                   ) -> dict[str, torch.Tensor]:
    """HF tensors (names, shapes, unpadded vocabulary) from Megatron tensors.

    `shards`: Megatron name with the *global* layer number (`global_layer_names`) and, for experts, the
    global expert number (`moe.global_expert_names`) -> the TP shards in
    TP-rank order (a list), or one tensor for a replicated one (norms). Local or TE norm names. Any
    subset of the model (e.g. one pipeline stage's) converts on its own. Tied embeddings: the output
    layer's copy is dropped (HF ties lm_head to embed_tokens). Pure: no communication."""
    groups, heads, d = config.num_query_groups, config.num_attention_heads, config.kv_channels
    vocab = hf_config.vocab_size
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    te_to_local = {te: local for local, te in _TE_NORMS.items()}
    out: dict[str, torch.Tensor] = {}
    for name, value in shards.items():
        parts = [value] if isinstance(value, torch.Tensor) else list(value)
        dim = tp_split_dim(name)
        full = parts[0] if dim is None else torch.cat(parts, dim=dim)
        if name == "embedding.word_embeddings.weight":
            out["model.embed_tokens.weight"] = full[:vocab]
            continue
        if name == "output_layer.weight":
            if not tied:
                out["lm_head.weight"] = full[:vocab]
            continue
        if name == "decoder.final_layernorm.weight":
            out["model.norm.weight"] = full
            continue
        m = _LAYER.match(name)
        if m is None:
            if name.endswith("_extra_state"):
                continue
            raise KeyError(f"megatron_to_hf: no HF name for {name!r}")
        hf, rest = f"model.layers.{m.group(1)}.", te_to_local.get(m.group(2), m.group(2))
        if rest.endswith("_extra_state"):
            continue
        if rest == "input_layernorm.weight":
            out[hf + "input_layernorm.weight"] = full
        elif rest == "pre_mlp_layernorm.weight":
            out[hf + "post_attention_layernorm.weight"] = full
        elif rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            kind = rest.rsplit(".", 1)[1]
            for p, t in zip("qkv", split_qkv(full, groups, heads, d)):
                out[hf + f"self_attn.{p}_proj.{kind}"] = t.contiguous()
        elif rest == "self_attention.linear_proj.weight":
            out[hf + "self_attn.o_proj.weight"] = full
        elif rest == "mlp.linear_fc1.weight":
            gate_up = [p.chunk(2, dim=0) for p in parts]  # each rank's [gate_r; up_r]
            out[hf + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in gate_up])
            out[hf + "mlp.up_proj.weight"] = torch.cat([u for _, u in gate_up])
        elif rest == "mlp.linear_fc2.weight":
            out[hf + "mlp.down_proj.weight"] = full
        elif rest in _MG_QK_NORMS:
            out[hf + _MG_QK_NORMS[rest]] = full
        elif rest == "mlp.router.weight" or rest.startswith("mlp.experts.local_experts."):
            router, experts = moe.hf_moe_names(hf_config, int(m.group(1)))
            if rest == "mlp.router.weight":
                out[router] = full
                continue
            expert, kind = rest[len("mlp.experts.local_experts."):].split(".", 1)
            gate_name, up_name, down_name = experts[int(expert)]
            if kind == "linear_fc1.weight":
                gate_up = [p.chunk(2, dim=0) for p in parts]
                out[gate_name] = torch.cat([g for g, _ in gate_up])
                out[up_name] = torch.cat([u for _, u in gate_up])
            elif kind == "linear_fc2.weight":
                out[down_name] = full
            else:
                raise KeyError(f"megatron_to_hf: no HF name for {name!r}")
        else:
            raise KeyError(f"megatron_to_hf: no HF name for {name!r}")
    return {k: v.contiguous() for k, v in out.items()}
