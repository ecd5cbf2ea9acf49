"""The Hugging Face backbone for a recipe, built the way DeepSpeed needs it (ZeRO-3 partitioned as it is
created, AutoTP's module names), and wrapped with the numeric objective."""

from __future__ import annotations

import os

import torch

from numloss.adapters.hf import NumericCausalLM, numeric_autotp_model

from recipes.config import Recipe

from ..pure.contract import autotp_problem
from .moe import MoeNumericCausalLM, is_moe_model, moe_routing


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
    # transformers 5 refuses to load a checkpoint with key renamings (Llama's included) while the live
    # config names AutoTP; the load only needs the ZeRO-3 partitioning (AutoTP slices the model later,
    # in deepspeed.initialize), so it sees the config without its tensor_parallel section
    load_config = {k: v for k, v in ds_config.items() if k != "tensor_parallel"}
    live = HfDeepSpeedConfig(load_config) if ds_config["zero_optimization"]["stage"] == 3 else None
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
                                     trust_remote_code=m.trust_remote_code, **load_placement(recipe, device))
    if m.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    log_attention(model, attn)
    return model, live


def load_placement(recipe: Recipe, device: torch.device) -> dict:
    """Where `from_pretrained` puts the weights as it reads them. Below ZeRO-3 on a GPU without AutoTP,
    straight onto this rank's GPU (`device_map`), one checkpoint shard at a time through host RAM,
    instead of the whole model in host RAM on every rank of the node. ZeRO-3 builds partitioned under
    the live HfDeepSpeedConfig; AutoTP (DeepSpeed 0.19.8) slices a model that is already whole, so
    below ZeRO-3 with tp_size > 1 every rank still holds the whole model in host RAM at load
    (recipes.validate reports it). On the CPU nothing changes."""
    ds = recipe.deepspeed
    if device.type == "cuda" and ds.zero_stage < 3 and ds.tp_size == 1 and not ds.offload_params:
        return {"device_map": {"": device}}
    return {}


def attention_used(model) -> str:
    """The attention implementation the built model runs (its language model's, for vision models)."""
    config = model.config
    text = getattr(config, "text_config", None)
    return getattr(text, "_attn_implementation", None) or config._attn_implementation


def log_attention(model, asked: str) -> str:
    """Print (rank 0) the attention implementation actually used, and warn when it is not the one asked
    for: a silent fall-back (e.g. to sdpa when flash-attn is missing) costs memory and speed at scale."""
    used = attention_used(model)
    if os.environ.get("RANK", "0") == "0":
        note = "" if used == asked else f" (asked for {asked}: WARNING, transformers fell back)"
        print(f"[numloss] attention implementation: {used}{note}", flush=True)
    return used


def _default_attention(device: torch.device) -> str:
    if device.type == "cuda":
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"


def training_module(model, objective, recipe: Recipe):
    """What `deepspeed.initialize` receives: the HF model wrapped with the numeric objective
    (NumericCausalLM), or under AutoTP (`deepspeed.tp_size` > 1) the HF model itself computing it
    (`numeric_autotp_model`). Either way its forward takes (input_ids, labels, attention_mask, ...,
    loss_counts=, sequence_ids=, diagnostics=), returns a NumericLMOutput, and `counts(labels, sequence_ids)` gives a
    batch's loss denominators. A mixture-of-experts model (router/aux on) gets `MoeNumericCausalLM`, whose
    output also holds `router_aux` (`recipes.engines.deepspeed.runtime.moe`); AutoTP is refused for it."""
    chunked = recipe.loss.head == "chunked"
    if is_moe_model(model) and recipe.deepspeed.tp_size > 1:
        raise ValueError(f"deepspeed.tp_size: {recipe.deepspeed.tp_size} on a mixture-of-experts model "
                         f"({type(model).__name__}): AutoTP is not tested with its experts and routers; use "
                         "deepspeed.tp_size 1 (ZeRO shards the experts) or train.engine: megatron (megatron.ep_size)")
    routing = moe_routing(model, recipe.loss.router_aux_coeff)
    if routing is not None:
        return MoeNumericCausalLM(model, objective, routing, chunked=chunked, chunk_size=recipe.loss.chunk_size)
    if recipe.deepspeed.tp_size > 1:
        problem = autotp_problem(model.config, recipe.deepspeed.tp_size, recipe.deepspeed.zero_stage)
        if problem:
            raise ValueError(problem)
        return numeric_autotp_model(model, objective, chunked, recipe.loss.chunk_size)
    return NumericCausalLM(model, objective, chunked=chunked, chunk_size=recipe.loss.chunk_size)
