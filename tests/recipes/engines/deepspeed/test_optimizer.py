"""Which AdamW runs the step (recipes.engines.deepspeed.optimizer).

Not reachable on CPU: constructing DeepSpeed's FusedAdam (a CUDA kernel); the choice is what is checked."""

from __future__ import annotations

import torch

from recipes.config import recipe_from_dict
from recipes.engines.deepspeed.optimizer import build_optimizer, optimizer_kind
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
