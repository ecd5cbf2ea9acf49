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

Atomic: the shards, then the index, config and tokenizer (last) are written into `.final.partial` beside
`final/`, fsynced, and switched in by rank 0 only when every rank has reported its shard written; a
rank that fails reports its error to the others (no rank is left waiting), the staging directory is
removed and the previous `final/` stays as it was (or there is none): never a mix of old and new shards.

LoRA (`model.lora` with `export_merged`): each LoRA layer is one unit of the plan, its base weight and
adapters gathered together, and written as the layer it replaced, `W + alpha/r · B A`
(`recipes.engines.deepspeed.lora.merged_weight`): the merged model under the base model's own keys.

Layout (transformers' own for sharded checkpoints): `model-00001-of-0000N.safetensors` ... and
`model.safetensors.index.json` = {"metadata": {"total_size": bytes}, "weight_map": {key: file}}; a
single shard is written as `model.safetensors` with no index.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from recipes.reliability.checkpoints import fsync_path
from recipes.training.file_modes import give_default_mode
from recipes.training.runtime import Runtime

from .lora import is_lora_layer, merged_weight

PREFIX = "model."  # NumericCausalLM holds the HF model as `.model` (recipes.engines.deepspeed.model.training_module)
INDEX = "model.safetensors.index.json"


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


def shard_name(index: int, count: int) -> str:
    return "model.safetensors" if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def export_model(engine, model, tokenizer, path: Path, runtime: Runtime, zero_stage: int, tp_size: int) -> dict:
    """Write the sharded export of `engine.module.model` (see the module docstring). Returns this rank's
    {"file", "keys", "bytes"} (file None when the plan gave it nothing)."""
    import deepspeed
    from deepspeed.module_inject.layers import GatherReplacedLayerParams
    from safetensors.torch import save_file

    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4 has no key conversions to revert
        def revert_weight_conversion(model, state):
            return state

    world = dist.get_world_size()
    modules = _modules_with_state(engine.module)
    # the plan from rank 0's view of the sizes: AutoTP slices can be uneven across TP ranks, and every
    # rank must agree on who keeps what
    sizes = [[sum(_local_numel(p) for p in _unit_parameters(m)) for _, m in modules]]
    dist.broadcast_object_list(sizes, src=0)
    owners = plan(sizes[0], world)
    writers = sorted(set(owners))
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
    count = len(writers)
    file = shard_name(writers.index(runtime.rank), count) if runtime.rank in writers else None
    path = Path(path)
    staging = staging_dir(path)
    if runtime.is_main:
        shutil.rmtree(staging, ignore_errors=True)  # a failed export's leftovers
        staging.mkdir(parents=True)
    dist.barrier()  # the directory exists on shared storage before anyone writes into it
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    error = None
    try:
        if file is not None:
            save_file(state, str(staging / file), metadata={"format": "pt"})
            fsync_path(staging / file)
        elif state:
            raise RuntimeError(f"rank {runtime.rank} holds {len(state)} tensors but no shard file in the plan")
    except Exception as err:  # noqa: BLE001  (every rank must learn of it, or the others wait forever)
        error = f"rank {runtime.rank}: {type(err).__name__}: {err}"
    mine_info = {"file": file, "keys": sorted(state), "bytes": nbytes, "error": error}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine_info)  # also: every shard is on disk past this point
    errors = [info["error"] for info in everyone if info["error"]]
    if not errors and runtime.is_main:
        try:
            _finish(everyone, count, model, tokenizer, staging, path)
        except Exception as err:  # noqa: BLE001
            errors.append(f"rank 0 (index, config, switch): {type(err).__name__}: {err}")
    verdict = [errors]
    dist.broadcast_object_list(verdict, src=0)  # rank 0 has switched `path` in, or not
    if verdict[0]:
        if runtime.is_main:
            shutil.rmtree(staging, ignore_errors=True)
        kept = f"the previous {path} is unchanged" if path.is_dir() else f"no {path} was written"
        raise RuntimeError(f"export to {path} failed ({kept}): " + "; ".join(verdict[0]))
    mine_info.pop("error")
    return mine_info


def staging_dir(path: Path) -> Path:
    """Where an export is written before it is switched in: beside `path`, hidden."""
    return path.parent / f".{path.name}.partial"


def _finish(everyone: list, count: int, model, tokenizer, staging: Path, path: Path) -> None:
    """Rank 0, once every shard is on disk: the index, config and tokenizer last, everything fsynced,
    then the staging directory switched in for `path` (an atomic exchange where the file system has
    one, else two renames) and the previous export removed."""
    weight_map: dict[str, str] = {}
    for info in everyone:
        for key in info["keys"]:
            if key in weight_map:
                raise RuntimeError(f"export: {key} written by two ranks ({weight_map[key]}, {info['file']})")
            weight_map[key] = info["file"]
    if count > 1:
        index = {"metadata": {"total_size": sum(i["bytes"] for i in everyone)},
                 "weight_map": dict(sorted(weight_map.items()))}
        (staging / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    model.config.save_pretrained(str(staging))
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(str(staging))
    tokenizer.save_pretrained(str(staging))
    give_default_mode(staging)  # safetensors writes its shards 0600, the rest is 0644
    for f in staging.iterdir():
        if f.is_file():
            fsync_path(f)
    fsync_path(staging)
    if path.exists() and _exchange(staging, path):  # `path` is the new export, `staging` the old one
        shutil.rmtree(staging, ignore_errors=True)
    else:
        old = path.parent / f".{path.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            os.replace(path, old)  # a crash between these two renames leaves the previous export in `old`
        os.replace(staging, path)
        shutil.rmtree(old, ignore_errors=True)
    fsync_path(path.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(str(a)), at_fdcwd, os.fsencode(str(b)), rename_exchange) == 0


def read_export(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an export (sharded with its index, or a single `model.safetensors`) in one dict,
    keyed as in the files: for checks and tools; transformers' from_pretrained reads the directory as is."""
    from safetensors.torch import load_file

    path = Path(path)
    index = path / INDEX
    if not index.is_file():
        return load_file(str(path / "model.safetensors"))
    weight_map = json.loads(index.read_text())["weight_map"]
    out: dict[str, torch.Tensor] = {}
    for file in sorted(set(weight_map.values())):
        part = load_file(str(path / file))
        if set(part) != {k for k, f in weight_map.items() if f == file}:
            raise ValueError(f"{path / file}: its tensors differ from what {index.name} maps to it")
        out.update(part)
    return out
