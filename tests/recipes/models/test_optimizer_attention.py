"""Which AdamW runs the step, and the attention implementation a built model reports.

Not reachable on CPU: constructing DeepSpeed's FusedAdam (a CUDA kernel) and a real fall-back from
flash_attention_2 on a GPU without flash-attn; the choice and the log line are what is checked."""

from __future__ import annotations

import torch

from recipes.config import recipe_from_dict
from recipes.engines.deepspeed.optimizer import build_optimizer, optimizer_kind
from recipes.engines.deepspeed.model import build_model, log_attention
from recipes.experiments.tiny import tiny_llama_config

BASE = {"model": {"config": tiny_llama_config(64, hidden=16, layers=1, heads=2, kv_heads=1), "tokenizer": "t",
                  "dtype": "float32"}, "data": {"train": "d"}, "deepspeed": {"zero_stage": 0}}


def test_fused_adam_on_gpus_cpu_adam_offloaded_torch_on_cpu():
    recipe = recipe_from_dict(BASE)
    assert optimizer_kind(recipe, cuda=True) == "fused_adam"
    assert optimizer_kind(recipe, cuda=False) == "torch"
    assert optimizer_kind(recipe_from_dict(BASE, ["deepspeed.offload_optimizer=true"]), cuda=True) == "cpu_adam"
    opt = build_optimizer(recipe, [torch.nn.Parameter(torch.zeros(2))])  # this machine: no GPU
    assert type(opt) is torch.optim.AdamW


def test_the_attention_actually_used_is_logged(capsys):
    recipe = recipe_from_dict(BASE, ["model.attn_implementation=eager"])
    config = {"zero_optimization": {"stage": 0}}
    model, _ = build_model(recipe, config, torch.device("cpu"))
    assert capsys.readouterr().out.strip() == "[numloss] attention implementation: eager"
    model, _ = build_model(recipe_from_dict(BASE), config, torch.device("cpu"))  # default on CPU: sdpa
    assert capsys.readouterr().out.strip() == "[numloss] attention implementation: sdpa"
    assert log_attention(model, "flash_attention_2") == "sdpa"
    assert "(asked for flash_attention_2: WARNING, transformers fell back)" in capsys.readouterr().out
