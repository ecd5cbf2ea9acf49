"""The backbones the planner knows: the model config a recipe resolves to (local, cached, hub, or the
offline fallback table of the papers' backbones) and its parameter count from an empty-weight model.
DeepSpeed's own estimate of model-state memory is the DeepSpeed engine's (recipes.engines.deepspeed.pure.plan)."""

from __future__ import annotations

import os
from typing import Any

# ---- offline fallback metadata ------------------------------------------------------------------------
#
# Architecture of the papers' backbones, used only when the hub cannot be reached and the config is not
# in the local HF cache. Values are those of the public config.json files (Llama-3 8B/70B, Qwen2.5-1.5B,
# Qwen2.5-VL-7B, SmolLM3-3B); the parameter counts they give here match the published totals (8.03B,
# 70.55B, 1.54B, 8.29B with the vision tower, 3.08B). Ministral-3-3B is recalled, not checked against
# its config.json (confidence: low; 3.85B total = ~3.4B language model + ~0.4B Pixtral tower, which
# matches the announced size): prefer the hub's config when reachable.
# `vision_config` is only used for `model.vision: true` recipes (else the text part alone is built).

# Directories that `python -m recipes.experiments.backbone NAME` converts a packaged model into: (NAME, hub name).
CONVERTED_BACKBONES = {"SmolLM2-135M-Instruct.Q4_1": ("smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct")}

KNOWN_BACKBONES: dict[str, dict[str, Any]] = {
    "meta-llama/Meta-Llama-3-8B-Instruct": {
        "confidence": "high",
        "text": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                     max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                     tie_word_embeddings=False),
    },
    # Llama-3.1: Llama-3's shapes with 131,072 positions through its "llama3" RoPE scaling (long rows)
    "meta-llama/Llama-3.1-8B-Instruct": {
        "confidence": "medium (recalled; Llama-3-8B's shapes, which give 8.03B)",
        "text": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                     max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                     rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                     tie_word_embeddings=False),
    },
    "meta-llama/Meta-Llama-3-70B-Instruct": {
        "confidence": "high",
        "text": dict(model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                     num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                     max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                     tie_word_embeddings=False),
    },
    "Qwen/Qwen2.5-1.5B-Instruct": {
        "confidence": "high",
        "text": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                     num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                     max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=True),
    },
    "Qwen/Qwen2.5-VL-7B-Instruct": {
        "confidence": "high (text part); vision tower: medium",
        "text": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                     num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                     max_position_embeddings=128000, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=False),
        "vision_model_type": "qwen2_5_vl",
        "vision_config": dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                              out_hidden_size=3584, patch_size=14, spatial_merge_size=2,
                              temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31]),
    },
    "HuggingFaceTB/SmolLM2-135M-Instruct": {  # the demo's backbone (recipes.experiments.backbone converts its GGUF)
        "confidence": "high",
        "text": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                     num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                     max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                     tie_word_embeddings=True),
    },
    "HuggingFaceTB/SmolLM3-3B": {
        "confidence": "high",
        "text": dict(model_type="smollm3", vocab_size=128256, hidden_size=2048, intermediate_size=11008,
                     num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=4,
                     max_position_embeddings=65536, rms_norm_eps=1e-6, tie_word_embeddings=True),
    },
    # The two MoE classes of recipes/configs/scale/. Values of the public config.json files as
    # recalled (not fetched here: no hub); the counts they give (recipes.planning.moe.parameter_counts)
    # reproduce the published totals: Qwen3-30B-A3B 30.53B total / 3.35B active (Qwen: 30.5B / 3.3B),
    # Mixtral-8x22B 140.6B / 39.2B (Mistral: 141B / 39B). Prefer the hub's config when reachable.
    "Qwen/Qwen3-30B-A3B": {
        "confidence": "medium (recalled; reproduces the published 30.5B total / 3.3B active)",
        "text": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                     moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                     norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001,
                     max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=False),
    },
    "mistralai/Mixtral-8x22B-Instruct-v0.1": {
        "confidence": "medium (recalled; reproduces the published 141B total / 39B active)",
        "text": dict(model_type="mixtral", vocab_size=32768, hidden_size=6144, intermediate_size=16384,
                     num_hidden_layers=56, num_attention_heads=48, num_key_value_heads=8, num_local_experts=8,
                     num_experts_per_tok=2, router_aux_loss_coef=0.001, max_position_embeddings=65536,
                     rope_theta=1000000.0, rms_norm_eps=1e-5, sliding_window=None, tie_word_embeddings=False),
    },
    "mistralai/Ministral-3-3B-Instruct-2512": {
        "confidence": "low (recalled, not checked against config.json)",
        "text": dict(model_type="ministral3", vocab_size=131072, hidden_size=3072, intermediate_size=9216,
                     num_hidden_layers=26, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     tie_word_embeddings=True),
        "vision_model_type": "mistral3",
        "vision_config": dict(model_type="pixtral", hidden_size=1024, intermediate_size=4096,
                              num_hidden_layers=24, num_attention_heads=16, patch_size=14, image_size=1540),
    },
}



# ---- model config and size ----------------------------------------------------------------------------


def _config_from_table(name: str, vision: bool):
    from transformers import AutoConfig

    entry = KNOWN_BACKBONES[name]
    text = dict(entry["text"])
    if vision and "vision_config" in entry:
        kind = entry["vision_model_type"]
        text_cfg = dict(text)
        if kind == "qwen2_5_vl":
            text_cfg.pop("model_type")
        return AutoConfig.for_model(kind, text_config=text_cfg, vision_config=dict(entry["vision_config"]),
                                    tie_word_embeddings=text["tie_word_embeddings"])
    return AutoConfig.for_model(text.pop("model_type"), **text)


def resolve_model_config(recipe, offline: bool = False):
    """(transformers config, where it came from, warnings). Raises ValueError when nothing resolves."""
    from transformers import AutoConfig

    m = recipe.model
    notes: list[str] = []
    if m.config is not None:
        cfg = dict(m.config)
        kind = cfg.pop("model_type", None)
        if not kind:
            raise ValueError("model.config: needs a model_type (e.g. llama)")
        try:
            return AutoConfig.for_model(kind, **cfg), "model.config (random init)", notes
        except (ValueError, TypeError, KeyError) as err:
            raise ValueError(f"model.config: {err}") from None
    name = m.name_or_path
    if os.path.isdir(name):
        return AutoConfig.from_pretrained(name, trust_remote_code=m.trust_remote_code), f"local dir {name}", notes
    try:
        cfg = AutoConfig.from_pretrained(name, local_files_only=True, trust_remote_code=m.trust_remote_code)
        return cfg, "local Hugging Face cache", notes
    except Exception:  # noqa: BLE001  (not cached: any of several exception types)
        pass
    if not offline and os.environ.get("HF_HUB_OFFLINE", "0") in ("", "0", "false"):
        try:
            cfg = AutoConfig.from_pretrained(name, trust_remote_code=m.trust_remote_code)
            return cfg, "Hugging Face hub", notes
        except Exception as err:  # noqa: BLE001
            notes.append(f"model.name_or_path: hub unreachable for {name!r} ({type(err).__name__})")
    local = CONVERTED_BACKBONES.get(os.path.basename(os.path.normpath(name)))
    if local is not None:  # `python -m recipes.experiments.backbone` has not written this directory yet
        notes.append(f"model.name_or_path: {name} does not exist yet; `python -m recipes.experiments.backbone {local[0]}` "
                     f"writes it (the demo does so itself)")
        name = local[1]
    if name in KNOWN_BACKBONES:
        conf = KNOWN_BACKBONES[name]["confidence"]
        return _config_from_table(name, m.vision), f"offline fallback table (confidence: {conf})", notes
    raise ValueError(f"model.name_or_path: cannot resolve a config for {name!r} offline "
                     f"(known offline: {sorted(KNOWN_BACKBONES)})")


def count_parameters(config, vision: bool = False) -> tuple[int, int]:
    """(total parameters, parameters of the largest single module) of an empty-weight model built from
    `config` on the meta device (tied weights counted once)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    with torch.device("meta"):
        if vision:
            model = AutoModelForImageTextToText.from_config(config)
        else:
            model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once
    largest = max(sum(p.numel() for p in mod.parameters(recurse=False)) for mod in model.modules())
    return int(total), int(largest)
