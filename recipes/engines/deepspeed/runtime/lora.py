"""LoRA on the DeepSpeed engine (`model.lora`): PEFT adapters injected into the Hugging Face backbone,
the base frozen, the numeric objective unchanged.

`apply_lora` injects the adapters in place: the HF model keeps its class, names and forward (PEFT
replaces each targeted linear layer with a LoRA layer holding the original as `base_layer`), so the
training wrapper (`recipes.engines.deepspeed.runtime.model.training_module`), the objective and the chunked head
see the same model as without LoRA. Only the adapters require gradients, so the optimizer, ZeRO's
gradient partitions and the checkpoints hold the adapters alone: the frozen base is rebuilt from
`model.name_or_path` (or the seed) at every start, and ZeRO-3 partitions it like any other parameter.

Parallel contract: `apply_lora` runs on every rank before `deepspeed.initialize` (the adapters' random
initialisation draws from the same seeded RNG on every rank, and ZeRO-3 partitions them when the
engine is built); `save_adapter` is a collective (ZeRO-3 gathers the adapters on every rank, rank 0
writes). The merged export (`recipes.engines.deepspeed.runtime.export`) writes each LoRA layer as one weight,
`W + alpha/r · B A`, computed by `merged_weight`.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from recipes.sections import LoraSection
from recipes.training.file_modes import give_default_mode

ADAPTER = "default"  # PEFT's name for the one adapter a recipe trains


def apply_lora(model, section: LoraSection, gradient_checkpointing: bool = False):
    """Inject LoRA adapters into `model` (in place) and freeze everything else; returns PEFT's wrapper
    (`PeftModel`, for saving the adapter; `wrapper.base_model.model is model`)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:
        raise ImportError("model.lora needs PEFT: pip install 'numloss[hf]'") from err

    config = LoraConfig(r=section.r, lora_alpha=section.alpha, lora_dropout=section.dropout,
                        target_modules=section.target_modules, bias="none", task_type="CAUSAL_LM")
    wrapper = get_peft_model(model, config)
    if wrapper.base_model.model is not model:
        raise RuntimeError("PEFT did not inject the adapters into the model in place")
    if gradient_checkpointing:
        # the frozen embeddings give the checkpointed blocks inputs without grad: reentrant checkpointing
        # would then give the adapters inside them no gradient
        model.enable_input_require_grads()
    return wrapper


def trainable_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer steps: all of them without LoRA, the adapters with it."""
    return [p for p in module.parameters() if p.requires_grad]


def is_lora_layer(module: torch.nn.Module) -> bool:
    """A PEFT LoRA layer: the original layer as `base_layer` plus the `lora_A` / `lora_B` adapters."""
    return all(hasattr(module, name) for name in ("base_layer", "lora_A", "lora_B", "scaling"))


def merged_weight(layer: torch.nn.Module) -> torch.Tensor:
    """`W + alpha/r · B A` of a LoRA layer whose parameters are whole on this rank (gathered under
    ZeRO-3), computed in fp32 and returned in W's dtype. One adapter, plain LoRA (no DoRA)."""
    if set(layer.lora_A) != {ADAPTER} or getattr(layer, "use_dora", {}).get(ADAPTER, False):
        raise ValueError(f"cannot merge {type(layer).__name__}: expected one plain LoRA adapter {ADAPTER!r}")
    base = layer.base_layer.weight
    a, b = layer.lora_A[ADAPTER].weight.float(), layer.lora_B[ADAPTER].weight.float()
    delta = (b @ a) * layer.scaling[ADAPTER]
    if getattr(layer, "fan_in_fan_out", False):
        delta = delta.T
    return (base.float() + delta).to(base.dtype)


def save_adapter(peft_model, path: Path, tokenizer, is_main: bool, zero_stage: int) -> None:
    """The adapter in PEFT's format (`adapter_config.json`, `adapter_model.safetensors`) and the
    tokenizer in `path`: what `PeftModel.from_pretrained(base, path)` loads. A collective: rank 0's
    failure is raised on rank 0 after the barrier (the export writer tells every rank)."""
    import deepspeed

    adapters = [p for p in peft_model.parameters() if p.requires_grad]
    error = None
    with deepspeed.zero.GatheredParameters(adapters, enabled=zero_stage == 3):
        if is_main:
            try:
                path.mkdir(parents=True, exist_ok=True)
                peft_model.save_pretrained(str(path), safe_serialization=True)
                tokenizer.save_pretrained(str(path))
                give_default_mode(path)  # safetensors writes the adapter 0600, the rest is 0644
            except Exception as err:  # noqa: BLE001  (raised once every rank is past the barrier)
                error = err
    dist.barrier()
    if error is not None:
        raise error
