"""The optimizer DeepSpeed steps for a recipe: which AdamW (`optimizer_kind`) and the built one."""

from __future__ import annotations

import torch


def optimizer_kind(recipe, cuda: bool) -> str:
    """Which AdamW runs the step: "cpu_adam" (DeepSpeed's vectorised CPU Adam) under
    `deepspeed.offload_optimizer` (DeepSpeed refuses a client torch optimizer under ZeRO-Offload, which
    would be several times slower there), "fused_adam" (DeepSpeed's multi-tensor CUDA kernel, prebuilt in
    the image) on GPUs, "torch" (torch.optim.AdamW; nothing to compile) on the CPU. All in AdamW mode."""
    if recipe.deepspeed.offload_optimizer:
        return "cpu_adam"
    return "fused_adam" if cuda else "torch"


def build_optimizer(recipe, params) -> torch.optim.Optimizer:
    """AdamW with the recipe's settings, as `optimizer_kind` picks it."""
    o = recipe.optim
    kwargs = {"lr": o.lr, "betas": tuple(o.betas), "eps": o.eps, "weight_decay": o.weight_decay}
    kind = optimizer_kind(recipe, torch.cuda.is_available())
    if kind == "cpu_adam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, adamw_mode=True, **kwargs)
    if kind == "fused_adam":
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam(params, adam_w_mode=True, **kwargs)
    return torch.optim.AdamW(params, **kwargs)
