"""The backbone and its tokenizer (or processor) for a recipe, built the way DeepSpeed needs them."""

from __future__ import annotations

import torch

from numloss.adapters.hf import NumericCausalLM

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



class AutoTPNumericCausalLM(NumericCausalLM):
    """NumericCausalLM as DeepSpeed's AutoTP must see it. AutoTP partitions the module given to
    `deepspeed.initialize` and reads from it: `config` (attention and KV head counts; DeepSpeed 0.19.8
    refuses a vocab-parallel head on a module without them), the HF `tp_plan` (`config.base_model_tp_plan`
    and the class's `_tp_plan`; DeepSpeed matches its patterns with any prefix, so the wrapper's
    `model.` in front of every name is fine) and the `loss_function` hook its vocab-parallel head
    replaces. All three are the HF model's. Logits only: the chunked head needs the whole lm_head."""

    def __init__(self, model, objective):
        super().__init__(model, objective, chunked=False)
        plan = getattr(type(model), "_tp_plan", None)
        if plan:
            self._tp_plan = dict(plan)  # the instance's plan, where DeepSpeed looks for it

    @property
    def config(self):
        return self.model.config

    @property
    def loss_function(self):
        return self.model.loss_function

    @loss_function.setter
    def loss_function(self, fn):
        self.model.loss_function = fn


def training_module(model, objective, recipe: Recipe) -> NumericCausalLM:
    """What `deepspeed.initialize` receives: the HF model wrapped with the numeric objective, as
    `AutoTPNumericCausalLM` under AutoTP (`deepspeed.tp_size` > 1)."""
    chunked = recipe.loss.head == "chunked"
    if recipe.deepspeed.tp_size > 1:
        if chunked:
            raise ValueError("loss.head: chunked is not supported with deepspeed.tp_size > 1 (AutoTP shards the "
                             "lm_head along the vocabulary); use loss.head: logits")
        return AutoTPNumericCausalLM(model, objective)
    return NumericCausalLM(model, objective, chunked=chunked, chunk_size=recipe.loss.chunk_size)
