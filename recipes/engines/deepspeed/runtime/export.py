"""The Hugging Face export at the end of a run: a sharded safetensors model that every rank writes its
share of, with the index file transformers reads (`model.safetensors.index.json`), plus the config and
tokenizer (or processor).

Why sharded and written by every rank: at 70B the weights are ~141 GB in bf16. Gathered to rank 0 and
written there while every other rank waits in a barrier, the export needs 141 GB of free host RAM on
rank 0 and, below ~235 MB/s of storage bandwidth, runs past the 10-minute collective timeout. Here each
module's weights are gathered (ZeRO-3 partitions, then AutoTP slices) one module at a time, on every
rank, and only the rank that owns that module in the plan keeps a CPU copy; each rank then writes its
own file. Host RAM per rank: about the model's size / world size (+ the largest module).

Parallel contract: a collective; every rank calls `export_model` with the same engine. Works at ZeRO
0-3 with or without AutoTP (`deepspeed.tp_size`): under ZeRO-3 `GatheredParameters` reassembles each
parameter, under AutoTP DeepSpeed's `GatherReplacedLayerParams` reassembles the TP slices.

Written by the one export writer (`recipes.reliability.export_writer`): each rank's shard into the staging
directory, fsynced; rank 0 then writes the index, config, generation config, tokenizer and the record of
what `final/` holds, and switches the directory in atomically; a rank that fails reports its error to the
others (no rank is left waiting) and the previous `final/` stays as it was. This module only gathers the
weights and names them as transformers does.

LoRA (`model.lora` with `export_merged`): each LoRA layer is one unit of the plan, its base weight and
adapters gathered together, and written as the layer it replaced, `W + alpha/r · B A`
(`recipes.engines.deepspeed.runtime.lora.merged_weight`): the merged model under the base model's own keys.

Layout: one shard per rank that the plan gives modules, named as transformers names them
(`recipes.reliability.export_writer.shard_names`), with its index when there are several.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from recipes.reliability.export_writer import ExportRecord, HFFiles, Shard, write_export, write_shard
from recipes.training.runtime import Runtime

from .lora import is_lora_layer, merged_weight

PREFIX = "model."  # NumericCausalLM holds the HF model as `.model` (recipes.engines.deepspeed.runtime.model.training_module)


def _modules_with_state(root: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(prefix, module) for every module that holds parameters or persistent buffers itself, in
    `named_modules` order (the order `state_dict` uses); a LoRA layer is one unit with its sub-layers."""
    out = []
    lora_prefixes: list[str] = []
    for name, module in root.named_modules():
        prefix = f"{name}." if name else ""
        if any(prefix.startswith(p) for p in lora_prefixes):
            continue  # a LoRA layer's base layer or adapter: exported within the LoRA layer
        if is_lora_layer(module):
            lora_prefixes.append(prefix)
            out.append((prefix, module))
            continue
        persistent = [b for n, b in module.named_buffers(recurse=False)
                      if b is not None and n not in module._non_persistent_buffers_set]
        if list(module.parameters(recurse=False)) or persistent:
            out.append((prefix, module))
    return out


def _unit_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters exported with a unit: its own, or a LoRA layer's base weight and adapters."""
    return list(module.parameters(recurse=is_lora_layer(module)))


def _unit_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A unit's tensors by key (relative to its prefix), its parameters whole on this rank: its own
    parameters and persistent buffers, or a LoRA layer's merged weight (and the base layer's bias)."""
    if is_lora_layer(module):
        out = {"weight": merged_weight(module)}
        if getattr(module.base_layer, "bias", None) is not None:
            out["bias"] = module.base_layer.bias
        return out
    out = {name: p for name, p in module.named_parameters(recurse=False) if p is not None}
    out.update({name: b for name, b in module.named_buffers(recurse=False)
                if b is not None and name not in module._non_persistent_buffers_set})
    return out


def _local_numel(t: torch.Tensor) -> int:
    """Elements of a tensor as this rank sees it whole: ZeRO-3 keeps the full size in `ds_numel`."""
    return int(getattr(t, "ds_numel", t.numel()))


def plan(sizes: list[int], world_size: int) -> list[int]:
    """Writer rank of each module: greedy, largest first, onto the least-loaded rank (ties: lowest rank),
    so every rank writes about 1/world of the bytes. Deterministic: every rank computes the same plan."""
    load = [0] * world_size
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


def export_model(engine, model, tokenizer, path: Path, runtime: Runtime, zero_stage: int, tp_size: int,
                 record: ExportRecord | None = None, extra: Callable[[Path], None] | None = None) -> dict:
    """Write the sharded export of `engine.module.model` through the one export writer
    (`recipes.reliability.export_writer`; see the module docstring). `record`: what `final/` says it holds;
    `extra(staging)`: more of the export (LoRA's adapter), called on every rank after the shards. Returns
    this rank's {"file", "keys", "bytes"} (file None when the plan gave it nothing)."""

    def write_shards(staging: Path) -> list[Shard]:
        state = _rank_state(engine, model, runtime, zero_stage, tp_size)
        shards = [write_shard(staging, f"rank-{runtime.rank:05d}.safetensors", state)] if state else []
        if extra is not None:
            extra(staging)
        return shards

    if model is None:  # a LoRA adapter alone: no merged weights
        files = HFFiles()
    else:
        generates = getattr(model, "generation_config", None) is not None and model.can_generate()
        files = HFFiles(model.config, model.generation_config if generates else None, tokenizer)
    shards = write_export(path, write_shards, files, record)
    if not shards:
        return {"file": None, "keys": [], "bytes": 0}
    return {"file": shards[0].file, "keys": shards[0].keys, "bytes": shards[0].bytes}


def _rank_state(engine, model, runtime: Runtime, zero_stage: int, tp_size: int) -> dict[str, torch.Tensor]:
    """This rank's share of the HF state dict: every module gathered on every rank (a collective), the
    modules the plan gives this rank kept on its CPU, under the checkpoint's key names."""
    import deepspeed
    from deepspeed.module_inject.layers import GatherReplacedLayerParams

    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4 has no key conversions to revert
        def revert_weight_conversion(model, state):
            return state

    if model is None:
        return {}
    world = dist.get_world_size()
    modules = _modules_with_state(engine.module)
    # the plan from rank 0's view of the sizes: AutoTP slices can be uneven across TP ranks, and every
    # rank must agree on who keeps what
    sizes = [[sum(_local_numel(p) for p in _unit_parameters(m)) for _, m in modules]]
    dist.broadcast_object_list(sizes, src=0)
    owners = plan(sizes[0], world)
    mine: dict[str, torch.Tensor] = {}
    seen: set[int] = set()  # tied weights (the same Parameter in two modules) are written once
    for (prefix, module), owner in zip(modules, owners):
        params = _unit_parameters(module)
        with deepspeed.zero.GatheredParameters(params, enabled=zero_stage == 3 and bool(params)):
            with GatherReplacedLayerParams(params, module, enabled=tp_size > 1 and bool(params)):
                if runtime.rank != owner:
                    continue
                for name, t in _unit_state(module).items():
                    if isinstance(t, torch.nn.Parameter):  # a live object: its id cannot be reused meanwhile
                        if id(t) in seen:
                            continue
                        seen.add(id(t))
                    mine[prefix + name] = t.detach().to("cpu", copy=True).contiguous()
    # tied weights: a Parameter seen by another rank's module first would be written twice; the key
    # kept is the one transformers expects (its tied-weight *targets* are dropped)
    tied_targets = getattr(model, "all_tied_weights_keys", None)  # transformers 5: {target: source}
    if tied_targets is None:  # transformers 4: a list of targets, tied when the config says so
        tied = getattr(model.config, "tie_word_embeddings", False)
        tied_targets = getattr(model, "_tied_weights_keys", None) or [] if tied else []
    tied_targets = set(tied_targets)
    # NumericCausalLM holds the HF model as `.model`; under AutoTP the engine's module is the HF model
    prefix = "" if engine.module is model else PREFIX
    state = {k[len(prefix):]: v for k, v in mine.items() if k.startswith(prefix)}
    state = {k: v for k, v in state.items() if k not in tied_targets}
    if getattr(model, "_weight_conversions", None) is not None:
        # transformers 5 loading under ZeRO-3 records extra legacy renamings whose reverse writes keys such
        # as `language_model.model.model.*` (LLaVA); without the record it writes the class's canonical
        # checkpoint format, the one its own save_pretrained writes.
        model._weight_conversions = None
    if state:
        state = revert_weight_conversion(model, state)  # the checkpoint's key names, as save_pretrained
    return state
