"""The optimizer DeepSpeed steps for a recipe: which AdamW (`optimizer_kind`) and the built one."""

from __future__ import annotations

import torch


def fused_adam_prebuilt() -> bool:
    """Whether this DeepSpeed install holds its fused_adam op prebuilt (DS_BUILD_FUSED_ADAM=1 at install, as
    the Dockerfile builds it). Without it, FusedAdam's first use JIT-compiles the op with nvcc: about a minute
    of every fresh node's start, inside the run's clock."""
    from deepspeed.git_version_info import installed_ops

    return bool(installed_ops.get("fused_adam"))


def optimizer_kind(recipe, cuda: bool, fused_adam_built: bool = False) -> str:
    """Which AdamW runs the step: "cpu_adam" (DeepSpeed's vectorised CPU Adam) under
    `deepspeed.offload_optimizer` (DeepSpeed refuses a client torch optimizer under ZeRO-Offload, which
    would be several times slower there); on GPUs "fused_adam" (DeepSpeed's multi-tensor CUDA kernel) where
    it is prebuilt (`fused_adam_built`), else "torch_fused" (torch.optim.AdamW(fused=True): a fused CUDA
    step that compiles nothing at run time); "torch" (torch.optim.AdamW) on the CPU. All in AdamW mode."""
    if recipe.deepspeed.offload_optimizer:
        return "cpu_adam"
    if not cuda:
        return "torch"
    return "fused_adam" if fused_adam_built else "torch_fused"


def build_optimizer(recipe, params) -> tuple[torch.optim.Optimizer, str]:
    """AdamW with the recipe's settings, as `optimizer_kind` picks it; returns it and its kind."""
    o = recipe.optim
    kwargs = {"lr": o.lr, "betas": tuple(o.betas), "eps": o.eps, "weight_decay": o.weight_decay}
    cuda = torch.cuda.is_available()
    kind = optimizer_kind(recipe, cuda, fused_adam_built=cuda and fused_adam_prebuilt())
    if kind == "cpu_adam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, adamw_mode=True, **kwargs), kind
    if kind == "fused_adam":
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam(params, adam_w_mode=True, **kwargs), kind
    return torch.optim.AdamW(params, fused=kind == "torch_fused", **kwargs), kind
