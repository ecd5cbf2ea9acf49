"""The DeepSpeed config `deepspeed.initialize` receives for a recipe (the optimizer is `optimizer.py`'s,
the LR schedule, shared by every engine, `recipes.training.schedule`'s). Pure: no torch, no deepspeed
(the planner reads the same config without either).

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

import json

from recipes.parallel_dims import ParallelDims


def deepspeed_config(recipe, world_size: int, pin_memory: bool = False) -> dict:
    """The DeepSpeed config a recipe implies (its `deepspeed.overrides` merged in last). `pin_memory`:
    offloaded state in pinned host memory (the engine passes whether it runs on GPUs)."""
    ds = recipe.deepspeed
    dp = data_parallel_size(recipe, world_size)
    zero: dict = {"stage": ds.zero_stage, **zero_comm_settings(recipe, world_size)}
    if ds.zero_stage == 3:
        # gather the 16-bit weights at save time so `final/` can be written without zero_to_fp32
        zero.update(stage3_gather_16bit_weights_on_model_save=True)
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin_memory}
    if ds.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin_memory}
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
    if ds.sp_size > 1:
        # DeepSpeed-Ulysses: DeepSpeed counts the batch over world / sp ranks (its config reads this key
        # where no groups object is given yet: the ZeRO-3 build under HF's live config)
        config["sequence_parallel_size"] = ds.sp_size
    if recipe.model.dtype == "bfloat16":
        # gradients accumulated in fp32 (ZeRO 1-3) and reduced in deepspeed.reduce_dtype: fp32 by default,
        # as bf16 sums of many ranks' gradients lose the small ones (an 8-bit mantissa); bf16 halves the
        # reduce-scatter's bytes (recipes.engines.deepspeed.pure.costs counts both)
        config["communication_data_type"] = ds.reduce_dtype
        if ds.zero_stage >= 1:
            config["data_types"] = {"grad_accum_dtype": "fp32"}
    if ds.tp_size > 1:
        config["tensor_parallel"] = {"autotp_size": ds.tp_size, "vocab_parallel_lm_head": True}
    return _merge(config, ds.overrides)


# What the generated config sets from a recipe key that the engine, its plan or the loop also read themselves:
# an override there would run one value while they decide by the other. (path in the config, the recipe key,
# its value, the value it gives at that path, who else reads the key.) Overrides elsewhere (bucket sizes,
# overlap_comm, hpZ, an offload's pin_memory or NVMe path, ...) refine what the keys say and are merged as
# they are.
_FROM_KEYS = (
    (("zero_optimization", "stage"), "deepspeed.zero_stage", lambda r: r.deepspeed.zero_stage,
     lambda r: r.deepspeed.zero_stage, "the engine's checkpoint layout, the export's gathers and the memory plan"),
    (("tensor_parallel", "autotp_size"), "deepspeed.tp_size", lambda r: r.deepspeed.tp_size,
     lambda r: r.deepspeed.tp_size, "the engine's rank groups, checkpoint layout and export, and the memory plan"),
    (("communication_data_type",), "deepspeed.reduce_dtype", lambda r: r.deepspeed.reduce_dtype,
     lambda r: r.deepspeed.reduce_dtype if r.model.dtype == "bfloat16" else None, "the traffic plan"),
    (("train_micro_batch_size_per_gpu",), "train.micro_batch_size", lambda r: r.train.micro_batch_size,
     lambda r: r.train.micro_batch_size, "the loop (the rows of its micro-batches)"),
    (("gradient_accumulation_steps",), "train.grad_accum", lambda r: r.train.grad_accum,
     lambda r: r.train.grad_accum, "the loop (micro-batches per step) and the loss's scaling"),
    (("gradient_clipping",), "optim.grad_clip", lambda r: r.optim.grad_clip,
     lambda r: r.optim.grad_clip, "the logged `clipped`"),
    (("bf16", "enabled"), "model.dtype", lambda r: r.model.dtype,
     lambda r: r.model.dtype == "bfloat16", "the model's load and the memory plan"),
    (("fp16", "enabled"), "model.dtype", lambda r: r.model.dtype,
     lambda r: False, "the model's load and the memory plan"),
)
# (the ZeRO offload in the config, the recipe key that turns it on, what it keeps off the GPU, who reads the key)
_OFFLOADS = (("offload_optimizer", "deepspeed.offload_optimizer", "the optimizer state",
              "the engine's optimizer choice and the memory plan"),
             ("offload_param", "deepspeed.offload_params", "the parameters",
              "the model's load placement and the memory plan"))
# settings DeepSpeed ignores or checks against what the recipe derives
_NOT_OVERRIDDEN = {
    "train_batch_size": "it is derived: train.micro_batch_size x train.grad_accum x the ranks (DeepSpeed refuses "
                        "any other value when it starts; train.global_batch_size checks the global batch)",
    "optimizer": "the optim section sets the optimizer; DeepSpeed ignores a config optimizer when it is given the "
                 "engine's",
    "scheduler": "the optim section sets the LR schedule; DeepSpeed ignores a config scheduler when it is given the "
                 "engine's",
}


def override_problems(recipe) -> list[str]:
    """Where `deepspeed.overrides` contradicts a recipe key the engine reads itself (`_FROM_KEYS`, the
    offloads), or sets what the recipe derives or DeepSpeed ignores (`_NOT_OVERRIDDEN`): each names the
    override and the key. Refused when the recipe loads, before a model is built on a config that says
    one thing while the engine decides by another (e.g. ZeRO-2 run, ZeRO-3 gathers at export)."""
    overrides = recipe.deepspeed.overrides or {}
    problems = [f"deepspeed.overrides.{key}: {why}: remove it" for key, why in _NOT_OVERRIDDEN.items()
                if key in overrides]
    for section in ("zero_optimization", "tensor_parallel", "bf16", "fp16"):
        if section in overrides and not isinstance(overrides[section], dict):
            problems.append(f"deepspeed.overrides.{section}: {_shown(overrides[section])} is not a mapping: it would "
                            f"replace what the recipe's keys set there; give the settings to change inside it")
    for path, key, value, gives, reads in _FROM_KEYS:
        found, set_to = _at(overrides, path)
        implied = gives(recipe)
        if found and implied is not None and set_to != implied:
            sets = f", which sets {_shown(implied)} there" if implied != value(recipe) else ""
            problems.append(f"deepspeed.overrides.{'.'.join(path)}: {_shown(set_to)} contradicts {key}: "
                            f"{_shown(value(recipe))}{sets} (read by {reads}): set {key} instead and remove it from "
                            f"deepspeed.overrides")
    zero = overrides.get("zero_optimization")
    for name, key, what, reads in _OFFLOADS:
        if not isinstance(zero, dict) or name not in zero:
            continue
        on = getattr(recipe.deepspeed, key.split(".")[1])
        value = zero[name]
        if value is not None and not isinstance(value, dict):
            continue  # not an offload config: DeepSpeed's own check names it
        device = (value or {}).get("device", "cpu" if on else "none") if value is not None else "none"
        if (device not in (None, "none")) == on:
            continue
        said = f"deepspeed.overrides.zero_optimization.{name}: {_shown(value)}"
        if on:
            problems.append(f"{said} keeps {what} on the GPU, while {key} is true (read by {reads}): set {key}: "
                            f"false and remove it from deepspeed.overrides")
        else:
            problems.append(f"{said} offloads {what}, while {key} is false (read by {reads}): set {key}: true "
                            f"(the override may still refine the offload: an NVMe device, pin_memory)")
    return problems


def _at(tree: dict, path: tuple[str, ...]) -> tuple[bool, object]:
    """(whether `tree` sets `path`, the value there)."""
    for name in path:
        if not isinstance(tree, dict) or name not in tree:
            return False, None
        tree = tree[name]
    return True, tree


def _shown(value) -> str:
    return json.dumps(value)


def zero_comm_settings(recipe, world_size: int) -> dict:
    """ZeRO's communication settings for the recipe's shape (stages 1-3; what DeepSpeed's and HF's
    references set), all overridable in `deepspeed.overrides.zero_optimization`:

    - overlap_comm, contiguous_gradients: reductions overlap the backward; gradients go into one buffer.
    - bucket sizes scaled to the hidden size h (HF Trainer's "auto" values): reduce h^2, parameters
      below 10 h elements stay gathered (norms, biases); the ZeRO-3 prefetch bucket 0.9 h^2 or, when
      larger, a layer's largest matrix (h x I: Llama-3-70B's MLP matrices are 3.5 h^2), so the next
      matrix's gather can be in flight while the current one computes.
    - ZeRO-3 across nodes: hierarchical partitioning (hpZ, `zero_hpz_partition_size`) at the node's
      data-parallel ranks (GPUs per node / TP): a second copy of the parameters sharded inside each node,
      so the backward's all-gather stays on NVLink and only the forward gather and the gradient
      reduce-scatter cross the network.
    """
    if recipe.deepspeed.zero_stage == 0:
        return {}
    out: dict = {"overlap_comm": True, "contiguous_gradients": True}
    hidden, intermediate = model_dims(recipe)
    if hidden:
        out["reduce_bucket_size"] = hidden * hidden
        if recipe.deepspeed.zero_stage == 3:
            out["stage3_prefetch_bucket_size"] = max(int(0.9 * hidden * hidden), hidden * (intermediate or 0))
            out["stage3_param_persistence_threshold"] = 10 * hidden
    c = recipe.cluster
    per_node = c.ranks_per_node() // recipe.deepspeed.tp_size
    dp = ParallelDims.of(world_size, tp=recipe.deepspeed.tp_size).dp
    if recipe.deepspeed.zero_stage == 3 and c.nodes > 1 and c.gpus_per_node and 1 < per_node < dp \
            and dp % per_node == 0:
        out["zero_hpz_partition_size"] = per_node
    return out


def hidden_size(recipe) -> int | None:
    return model_dims(recipe)[0]


def model_dims(recipe) -> tuple[int | None, int | None]:
    """The backbone's (hidden size, intermediate size) (language model's, for vision models), from
    `model.config` or the model's config.json (local directory or HF cache; never the network); None
    when unknown."""
    m = recipe.model
    if m.config is not None:
        return m.config.get("hidden_size"), m.config.get("intermediate_size")
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(m.name_or_path, trust_remote_code=m.trust_remote_code,
                                         local_files_only=True)
    except Exception:  # noqa: BLE001  (not local or cached: DeepSpeed's default bucket sizes apply)
        return None, None
    cfg = getattr(cfg, "text_config", None) or cfg
    return getattr(cfg, "hidden_size", None), getattr(cfg, "intermediate_size", None)


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def data_parallel_size(recipe, world_size: int) -> int:
    """The data-parallel size (`ParallelDims`), or ValueError when the layout or the global batch breaks."""
    tp, sp = recipe.deepspeed.tp_size, recipe.deepspeed.sp_size
    dims = ParallelDims.of(world_size, tp=tp, cp=sp)
    if not dims.divides:
        raise ValueError(f"deepspeed.tp_size={tp} x deepspeed.sp_size={sp} does not divide the world size {world_size}"
                         if sp > 1 else f"deepspeed.tp_size={tp} does not divide the world size {world_size}")
    dp = dims.dp
    gbs = recipe.train.global_batch_size
    if gbs is not None and gbs != recipe.train.micro_batch_size * recipe.train.grad_accum * dp:
        raise ValueError(f"train.global_batch_size={gbs} != micro_batch_size {recipe.train.micro_batch_size}"
                         f" x grad_accum {recipe.train.grad_accum} x data-parallel size {dp}")
    return dp
