"""The backbone and its tokenizer (or processor) for a recipe, built the way DeepSpeed needs them."""

from __future__ import annotations

import torch

from .config import Recipe
from .vision import load_processor


def load_tokenizer(recipe: Recipe):
    """(tokenizer, processor): the processor (vision recipes only, else None) carries the tokenizer."""
    from transformers import AutoTokenizer

    source = recipe.model.tokenizer or recipe.model.name_or_path
    if recipe.model.vision:
        processor = load_processor(source, trust_remote_code=recipe.model.trust_remote_code)
        return processor.tokenizer, processor
    return AutoTokenizer.from_pretrained(source, trust_remote_code=recipe.model.trust_remote_code), None


def build_model(recipe: Recipe, ds_config: dict, device: torch.device):
    """The backbone, built under a live HfDeepSpeedConfig for ZeRO-3 so its weights are partitioned as
    they are created (and HF's own initialisation still runs). Vision recipes load the whole
    image-text model (AutoModelForImageTextToText): tower, projector and language model all train.
    A model built from `model.config` with random weights gets different weights under ZeRO-3 (made
    partition by partition) than under stages 0-2 from the same seed; pretrained weights are the same."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
    )
    from transformers.integrations import HfDeepSpeedConfig

    m = recipe.model
    dtype = getattr(torch, m.dtype)
    attn = m.attn_implementation or _default_attention(device)
    # The live config only tells transformers to build under zero.Init. Without `tensor_parallel` in
    # it: transformers 5 refuses `from_pretrained` under ZeRO-3 when it sees AutoTP there ("Weight
    # conversions ... with DeepSpeed Tensor Parallelism are not yet implemented"), while AutoTP itself
    # shards the zero.Init-built model later, in deepspeed.initialize.
    zero_init = {k: v for k, v in ds_config.items() if k != "tensor_parallel"}
    live = HfDeepSpeedConfig(zero_init) if ds_config["zero_optimization"]["stage"] == 3 else None
    auto = AutoModelForImageTextToText if m.vision else AutoModelForCausalLM
    if m.config is not None:
        config = dict(m.config)
        model_type = config.pop("model_type", None)
        if model_type is None:
            raise ValueError("model.config: needs a model_type (e.g. llama)")
        hf_config = AutoConfig.for_model(model_type, **config)
        hf_config._attn_implementation = attn
        model = auto.from_config(hf_config, dtype=dtype)
    else:
        model = auto.from_pretrained(m.name_or_path, dtype=dtype, attn_implementation=attn,
                                                     trust_remote_code=m.trust_remote_code)
    if m.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model, live


def _default_attention(device: torch.device) -> str:
    if device.type == "cuda":
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"
