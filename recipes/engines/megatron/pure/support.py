"""Which Hugging Face backbones the Megatron engine converts and trains, decided from their config alone
(AutoConfig: never the weights): the families, their attention details, the mixture-of-experts families,
RoPE, and a `megatron.load_converted` directory against the recipe's backbone.

Supported: `model_type` llama (SmolLM2 is one), qwen2 (QKV bias), mistral (no sliding window), qwen3
(dense: per-head RMSNorm on q and k before RoPE, head_dim independent of hidden / heads, no biases), and the
mixture-of-experts qwen3_moe and mixtral (router and experts: `moe.py`). RMSNorm, SwiGLU, RoPE (default,
linear, Llama-3 and YaRN scaling: `rope.py`), GQA, tied or untied embeddings. Anything else is refused
(`check_supported`: NotImplementedError naming the setting) rather than trained as a different model.

Pure: no torch, no megatron; `recipes.checks` and the planner ask these before any model is built, the
engine's conversion (`convert.py`) asks them again when it builds one.
"""

from __future__ import annotations

import json
from pathlib import Path

MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")
REFUSED_MOE_TYPES = {"qwen2_moe": "Qwen2-MoE's shared expert (with its own sigmoid gate) is not converted",
                     "deepseek_v3": "DeepSeek-V3's MLA attention and grouped routing are not converted",
                     "olmoe": "OLMoE is not converted"}
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral", "qwen3", *MOE_MODEL_TYPES)
QKV_BIAS_TYPES = ("qwen2",)  # q/k/v with a bias and no other linear layer (megatron's add_qkv_bias)
QK_NORM_TYPES = ("qwen3", "qwen3_moe")  # RMSNorm over each head's q and k before RoPE (megatron's qk_layernorm)

# RoPE kinds (transformers 5's `rope_parameters["rope_type"]`) the engine reproduces; rope.py computes them
REPRODUCED = ("default", "linear", "llama3", "yarn")
_PER_BATCH = {"dynamic": "HF recomputes its frequencies from each batch's length past max_position_embeddings",
              "longrope": "HF picks its short or long factors from each batch's length"}


# ---- the families ------------------------------------------------------------------------------------


def head_dim(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def qk_norm(hf_config) -> bool:
    """Whether the model normalises each head's q and k (Qwen3's `q_norm` / `k_norm`)."""
    return getattr(hf_config, "model_type", None) in QK_NORM_TYPES


def is_moe(hf_config) -> bool:
    return getattr(hf_config, "model_type", None) in MOE_MODEL_TYPES


def num_experts(hf_config) -> int:
    return hf_config.num_experts if hf_config.model_type == "qwen3_moe" else hf_config.num_local_experts


def expert_ffn_size(hf_config) -> int:
    return hf_config.moe_intermediate_size if hf_config.model_type == "qwen3_moe" else hf_config.intermediate_size


def renormalises_top_k(hf_config) -> bool:
    """Whether the top-k probabilities are divided by their sum (Mixtral always; Qwen3-MoE per
    `norm_topk_prob`). megatron's softmax-after-top-k (`moe_router_pre_softmax=False`) is exactly
    that; without renormalisation it is softmax first, top-k of the probabilities."""
    return hf_config.model_type == "mixtral" or bool(getattr(hf_config, "norm_topk_prob", False))


def check_supported_moe(hf_config) -> None:
    """Raise NotImplementedError for MoE configs the conversion would get wrong."""
    kind = getattr(hf_config, "model_type", None)
    if kind in REFUSED_MOE_TYPES:
        raise NotImplementedError(f"model_type {kind!r}: {REFUSED_MOE_TYPES[kind]}; the Megatron engine converts the"
                                  f" mixture-of-experts families {list(MOE_MODEL_TYPES)}")
    if kind not in MOE_MODEL_TYPES:
        return
    if kind == "qwen3_moe":
        if getattr(hf_config, "decoder_sparse_step", 1) != 1 or getattr(hf_config, "mlp_only_layers", None):
            raise NotImplementedError(f"decoder_sparse_step {hf_config.decoder_sparse_step}, mlp_only_layers "
                                      f"{hf_config.mlp_only_layers}: dense layers mixed with MoE layers are not "
                                      f"converted (every layer must be an MoE layer)")
    if float(getattr(hf_config, "router_jitter_noise", 0.0) or 0.0) > 0:
        raise NotImplementedError(f"router_jitter_noise {hf_config.router_jitter_noise}: the router's input noise "
                                  f"is not reproduced; set it to 0")
    if num_experts(hf_config) < hf_config.num_experts_per_tok:
        raise ValueError(f"num_experts_per_tok {hf_config.num_experts_per_tok} exceeds the "
                         f"{num_experts(hf_config)} experts")


def rope_settings(hf_config) -> tuple[float, dict | None]:
    """(rope theta, scaling dict or None) from a transformers 5 `rope_parameters` or a transformers 4
    `rope_theta` + `rope_scaling`. Raises NotImplementedError for what the engine cannot reproduce
    (rope.py's module docstring says why each kind is or is not)."""
    params = getattr(hf_config, "rope_parameters", None)
    if params and all(isinstance(v, dict) for v in params.values()):  # one per attention type (transformers 5)
        if len(params) != 1:
            raise NotImplementedError(f"RoPE per attention type ({sorted(params)}): the Megatron engine has one RoPE")
        params = next(iter(params.values()))
    if params:
        params = dict(params)
        theta = float(params.pop("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0))
    else:
        theta = float(getattr(hf_config, "rope_theta", None) or 10000.0)
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    if partial is not None and float(partial) != 1.0:
        raise NotImplementedError(f"partial_rotary_factor {partial}: the Megatron engine rotates the whole head")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in _PER_BATCH:
        raise NotImplementedError(f"rope scaling {kind!r}: {_PER_BATCH[kind]}; the Megatron engine fixes them when "
                                  f"it builds the model (supported: {list(REPRODUCED)})")
    if kind not in REPRODUCED:
        raise NotImplementedError(f"rope scaling {kind!r}: the Megatron engine supports {list(REPRODUCED)} RoPE (a "
                                  f"{kind} model would get the wrong positions)")
    if kind == "default":
        return theta, None
    return theta, {**params, "rope_type": kind}


def check_supported(hf_config) -> None:
    """Raise for configs this conversion would get wrong (rather than train a different model)."""
    kind = getattr(hf_config, "model_type", None)
    check_supported_moe(hf_config)  # the MoE families refused by name first
    if kind not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(f"model_type {kind!r}: the Megatron engine converts {list(SUPPORTED_MODEL_TYPES)}")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act {hf_config.hidden_act!r}: only SwiGLU (silu) is converted")
    if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
        raise NotImplementedError("attention_bias / mlp_bias: Megatron adds biases to q/k/v only (add_qkv_bias) or to"
                                  " every linear layer; a Llama with o_proj or MLP biases is not converted")
    layer_types = set(getattr(hf_config, "layer_types", None) or ())
    if layer_types - {"full_attention"}:
        raise NotImplementedError(f"layer_types {sorted(layer_types)}: Megatron's local attention has no sliding "
                                  "window; every layer must be full_attention (use_sliding_window: false)")
    window = getattr(hf_config, "sliding_window", None)
    uses_window = getattr(hf_config, "use_sliding_window", kind == "mistral")
    if uses_window and window is not None and window < hf_config.max_position_embeddings:
        raise NotImplementedError(f"sliding_window {window}: Megatron's local attention has none; set sliding_window:"
                                  f" null in the config if training sequences never exceed {window} tokens")
    rope_settings(hf_config)


def hf_config_for(recipe):
    """The HF config of the recipe's backbone: read from `model.name_or_path`, or built from
    `model.config` (`transformers.AutoConfig.for_model`, random weights)."""
    from transformers import AutoConfig

    m = recipe.model
    if m.config is not None:
        config = dict(m.config)
        model_type = config.pop("model_type", None)
        if model_type is None:
            raise ValueError("model.config: needs a model_type (e.g. llama)")
        return AutoConfig.for_model(model_type, **config)
    return AutoConfig.from_pretrained(m.name_or_path, trust_remote_code=m.trust_remote_code)


# ---- a converted backbone (`python -m recipes.convert`, converted.py) -----------------------------------

CONVERTED_JSON = "numloss_converted.json"
FORMAT = 1
# what must match between the converted backbone and the recipe's (the weights' shapes and meaning)
HF_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "tie_word_embeddings")


def hf_fields(hf_config) -> dict:
    return {key: getattr(hf_config, key, None) for key in HF_FIELDS}


def converted_problems(recipe, hf_config=None) -> list[str]:
    """What stops `megatron.load_converted` from starting this recipe, before any model is built: the
    directory is missing or not a finished conversion, or it holds another backbone or dtype. `hf_config`:
    the recipe's (default: read as the engine reads it, `hf_config_for`)."""
    where = recipe.megatron.load_converted
    path = Path(where)
    key = "megatron.load_converted"
    if not path.is_dir():
        return [f"{key}: {where} does not exist; make it with python -m recipes.convert RECIPE.yaml --out {where}"]
    info_path = path / CONVERTED_JSON
    if not info_path.is_file():
        return [f"{key}: {where} is not a finished conversion (no {CONVERTED_JSON}); convert again"]
    info = json.loads(info_path.read_text())
    if info.get("format") != FORMAT:
        return [f"{key}: {where} has format {info.get('format')}, this version reads {FORMAT}; convert again"]
    if hf_config is None:
        hf_config = hf_config_for(recipe)
    problems = []
    mine = hf_fields(hf_config)
    for field, value in info["hf_config"].items():
        if mine.get(field) != value:
            problems.append(f"{key}: {where} holds a backbone with {field} {value!r}, the recipe's model has "
                            f"{mine.get(field)!r} ({info.get('source')} was converted)")
    if info["dtype"] != recipe.model.dtype:
        problems.append(f"{key}: {where} was converted in {info['dtype']}, the recipe trains in {recipe.model.dtype}"
                        f"; convert again with model.dtype={recipe.model.dtype}")
    return problems
