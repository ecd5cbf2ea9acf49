"""What LoRA (`model.lora`) costs per GPU: a frozen base and a small trainable adapter, in place of
DeepSpeed's full fine-tuning estimate (`recipes.validate` prints it for a LoRA recipe).

Adapter parameters: r x (in + out) for every targeted linear layer (PEFT's matching: a module whose
name is a target or ends with "." + target; "all-linear": every linear layer but the output head).

Model states per GPU (P base parameters, A adapter parameters, e bytes per weight in model.dtype, d
data-parallel ranks):
- the frozen base: P x e, partitioned over d under ZeRO-3 (plus the largest module gathered whole
  during its forward and backward); no gradient, no optimizer state;
- the adapter: weights A x e (ZeRO-3: / d), fp32 gradients A x 4 (ZeRO 2-3: / d), optimizer states
  A x (8 Adam moments + 4 fp32 master weights under bf16) (ZeRO 1-3: / d).
`deepspeed.offload_optimizer` moves the adapter's optimizer states to host RAM, `offload_params`
(ZeRO-3) the base's partition.
"""

from __future__ import annotations


def _targets_match(name: str, targets) -> bool:
    if isinstance(targets, str):
        targets = [targets]
    return any(name == t or name.endswith("." + t) for t in targets)


def adapter_parameters(config, targets, r: int, vision: bool = False) -> tuple[int, int]:
    """(adapter parameters, adapted layers) of the model `config` builds, from an empty-weight
    (meta device) model: nothing allocated."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    with torch.device("meta"):
        model = (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_config(config)
    head = model.get_output_embeddings()
    total = layers = 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        chosen = module is not head if targets == "all-linear" else _targets_match(name, targets)
        if chosen:
            total += r * (module.in_features + module.out_features)
            layers += 1
    return total, layers


def lora_memory_estimate(base_params: int, largest_params: int, adapter: int, *, zero_stage: int,
                         dp: int, ranks_per_node: int, weight_bytes: int, offload_optimizer: bool = False,
                         offload_params: bool = False) -> dict:
    """Model-state bytes per GPU and offloaded bytes per node (the module docstring's formulas), in
    the form of `recipes.planning.backbones.zero_memory_estimate`."""
    dp = max(dp, 1)
    base = base_params * weight_bytes / (dp if zero_stage == 3 else 1)
    gathered = largest_params * weight_bytes if zero_stage == 3 else 0
    weights = adapter * weight_bytes / (dp if zero_stage == 3 else 1)
    grads = adapter * 4 / (dp if zero_stage >= 2 else 1)
    optimizer = adapter * (8 + (4 if weight_bytes == 2 else 0)) / (dp if zero_stage >= 1 else 1)
    cpu = 0.0
    if offload_optimizer:
        cpu, optimizer = cpu + optimizer, 0.0
    if offload_params and zero_stage == 3:
        cpu, base = cpu + base, 0.0
    return {"gpu_bytes": int(base + gathered + weights + grads + optimizer), "cpu_bytes": int(cpu * ranks_per_node),
            "function": f"recipes.planning.lora (frozen base, {adapter:,} adapter parameters)"}
