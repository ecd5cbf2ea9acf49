"""What `deepspeed.initialize` receives for a recipe: the DeepSpeed config, the optimizer and the LR schedule.

Batch bookkeeping: one optimizer step is `grad_accum` micro-batches of `micro_batch_size` rows on each
data-parallel rank; tensor-parallel ranks of one group see the same rows. DeepSpeed 0.19.8 checks
`train_batch_size == micro_batch x grad_accum x world size` when it parses the config, before AutoTP has
made its groups, so its "world size" is every rank, the tensor-parallel ones too
(`DeepSpeedConfig.__init__`: `dist.get_world_size()` without an mpu). Under AutoTP the config therefore
says `micro_batch x grad_accum x world` (tp times the rows actually trained per step); DeepSpeed uses
that number only for its own sample counters. The recipe's `train.global_batch_size` is the real one,
`micro_batch x grad_accum x data-parallel size`.
"""

from __future__ import annotations

import math

import torch

from .config import Recipe


def deepspeed_config(recipe: Recipe, world_size: int) -> dict:
    """The DeepSpeed config a recipe implies (its `deepspeed.overrides` merged in last)."""
    ds = recipe.deepspeed
    dp = data_parallel_size(recipe, world_size)
    zero: dict = {"stage": ds.zero_stage}
    if ds.zero_stage == 3:
        # gather the 16-bit weights at save time so `final/` can be written without zero_to_fp32
        zero.update(stage3_gather_16bit_weights_on_model_save=True)
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if ds.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    config = {
        "train_micro_batch_size_per_gpu": recipe.train.micro_batch_size,
        "gradient_accumulation_steps": recipe.train.grad_accum,
        # DeepSpeed's count, TP ranks included (see the module docstring); dp * tp == world_size
        "train_batch_size": recipe.train.micro_batch_size * recipe.train.grad_accum * dp * ds.tp_size,
        "gradient_clipping": recipe.optim.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": recipe.model.dtype == "bfloat16"},
        "steps_per_print": 10**9,  # progress and metrics are ours
        "wall_clock_breakdown": False,
    }
    if ds.tp_size > 1:
        config["tensor_parallel"] = {"autotp_size": ds.tp_size, "vocab_parallel_lm_head": True}
    return _merge(config, ds.overrides)


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def data_parallel_size(recipe: Recipe, world_size: int) -> int:
    tp = recipe.deepspeed.tp_size
    if world_size % tp:
        raise ValueError(f"deepspeed.tp_size={tp} does not divide the world size {world_size}")
    dp = world_size // tp
    gbs = recipe.train.global_batch_size
    if gbs is not None and gbs != recipe.train.micro_batch_size * recipe.train.grad_accum * dp:
        raise ValueError(f"train.global_batch_size={gbs} != micro_batch_size {recipe.train.micro_batch_size}"
                         f" x grad_accum {recipe.train.grad_accum} x data-parallel size {dp}")
    return dp


def build_optimizer(recipe: Recipe, params) -> torch.optim.Optimizer:
    """AdamW with the recipe's settings. With `deepspeed.offload_optimizer` the step runs on the CPU in
    DeepSpeed's vectorised CPU Adam (AdamW mode; a C++ op built on first use): DeepSpeed refuses a
    client torch optimizer under ZeRO-Offload, which would be several times slower there."""
    o = recipe.optim
    kwargs = {"lr": o.lr, "betas": tuple(o.betas), "eps": o.eps, "weight_decay": o.weight_decay}
    if recipe.deepspeed.offload_optimizer:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, adamw_mode=True, **kwargs)
    return torch.optim.AdamW(params, **kwargs)


def lr_lambda(recipe: Recipe):
    """Linear warmup to the peak, then cosine down to `min_lr_ratio` of it (or constant)."""
    warmup, total, floor = recipe.optim.warmup_steps, recipe.train.steps, recipe.optim.min_lr_ratio

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if recipe.optim.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
