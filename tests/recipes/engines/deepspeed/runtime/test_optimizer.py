"""Which AdamW runs the step (recipes.engines.deepspeed.runtime.optimizer).

Not reachable on CPU: constructing DeepSpeed's FusedAdam or torch's fused AdamW (CUDA kernels); the choice is
what is checked, and that this DeepSpeed install (built with no ops, as pip builds it) says fused_adam is not
prebuilt, so a GPU node set up from the package index steps with torch's fused AdamW and compiles nothing."""

from __future__ import annotations

import torch

from recipes.config import recipe_from_dict
from recipes.engines.deepspeed.runtime.optimizer import build_optimizer, fused_adam_prebuilt, optimizer_kind
from recipes.experiments.tiny import tiny_llama_config

BASE = {"model": {"config": tiny_llama_config(64, hidden=16, layers=1, heads=2, kv_heads=1), "tokenizer": "t",
                  "dtype": "float32"}, "data": {"train": "d"}, "deepspeed": {"zero_stage": 0}}


def test_fused_adam_where_prebuilt_torch_fused_on_other_gpus_cpu_adam_offloaded_torch_on_cpu():
    recipe = recipe_from_dict(BASE)
    assert optimizer_kind(recipe, cuda=True, fused_adam_built=True) == "fused_adam"
    assert optimizer_kind(recipe, cuda=True, fused_adam_built=False) == "torch_fused"
    assert optimizer_kind(recipe, cuda=False) == "torch"
    assert optimizer_kind(recipe_from_dict(BASE, ["deepspeed.offload_optimizer=true"]), cuda=True) == "cpu_adam"
    assert fused_adam_prebuilt() is False  # pip's DeepSpeed: no op prebuilt
    opt, kind = build_optimizer(recipe, [torch.nn.Parameter(torch.zeros(2))])  # this machine: no GPU
    assert type(opt) is torch.optim.AdamW and kind == "torch" and not opt.defaults["fused"]
