"""LoRA's (`model.lora`) adapter: r x (in + out) parameters for every targeted linear layer (PEFT's matching:
a module whose name is a target or ends with "." + target; "all-linear": every linear layer but the output
head). What a frozen base and the adapter cost per GPU is each engine's (its cost model).
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
