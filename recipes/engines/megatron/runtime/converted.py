"""A backbone converted once from Hugging Face safetensors into a megatron-core distributed checkpoint
(`python -m recipes.convert`), and a run's start from it (`megatron.load_converted`).

Without it every rank of every start converts its share of the HF checkpoint again (the whole 140 GB
read at 70B at each start; a resume reads only the run's checkpoint). The converted directory holds
the model's weights in `megatron.core.dist_checkpointing` form (the same sharded tensors as a run
checkpoint's model part: global layer numbers, full shapes), so it loads at any TP / PP / VP layout,
whatever layout converted it; the vocabulary padding, which depends on TP, reshards as in a run
checkpoint (megatron loads the embedding's overlap and zero-fills the rest). `CONVERTED_JSON` records
what was converted (source, model type and shape, dtype, layout, layer spec); it is written last, so a
directory without it is not a finished conversion. The conversion is written into `<out>.partial` and
renamed to `<out>` when complete.

Parallel contract: `save_converted` and `load_converted` are collectives over the world (every rank
with its own chunks, the same directory on storage every rank sees); each rank writes or reads its
shards only. Whether a directory can start a recipe is `support.converted_problems` (pure: two small
JSON files, no collective).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

import torch.distributed as dist

from recipes.reliability.export_writer import agree
from recipes.training.runtime import setup_distributed, teardown

from .checkpoints import writer_queue_dies_with_rank
from .convert import SafetensorsReader
from .model import build_model_chunks, initialize_model_parallel, release_model_parallel
from ..pure.support import CONVERTED_JSON, FORMAT, hf_fields

def _model_request(model_chunks: list) -> dict:
    from .export import unwrap

    return {f"chunk{i}": unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(model_chunks)}


def partial_dir(out: Path) -> Path:
    return out.parent / f"{out.name}.partial"


def save_converted(out: str | Path, model_chunks: list, recipe, hf_config) -> dict:
    """Write this rank's chunks into `<out>.partial`, then (rank 0) `CONVERTED_JSON` and the rename to
    `out`. Refuses an existing `out`. Returns what `CONVERTED_JSON` holds. Collective."""
    from megatron.core import dist_checkpointing, parallel_state

    out = Path(out)
    staging = partial_dir(out)
    started = time.perf_counter()
    error = None
    if dist.get_rank() == 0:
        try:
            if out.exists():
                raise FileExistsError(f"{out} exists; remove it or convert into another directory")
            shutil.rmtree(staging, ignore_errors=True)  # a crashed conversion's leftovers
            staging.mkdir(parents=True)
        except OSError as e:
            error = e
    agree("preparing the directory", error, what="save_converted")  # every rank fails with rank 0, none waits
    writer_queue_dies_with_rank()
    dist_checkpointing.save({"model": _model_request(model_chunks)}, str(staging))
    info = {"format": FORMAT, "source": recipe.model.name_or_path, "dtype": recipe.model.dtype,
            "hf_config": hf_fields(hf_config),
            "layout": {"tp": parallel_state.get_tensor_model_parallel_world_size(),
                       "pp": parallel_state.get_pipeline_model_parallel_world_size(),
                       "vp": recipe.megatron.virtual_pp_size},
            "layer_spec": getattr(getattr(model_chunks[0], "kernel_plan", None), "spec", None),
            "seconds": round(time.perf_counter() - started, 1)}
    dist.barrier()  # every rank's shards are written
    if dist.get_rank() == 0:
        (staging / CONVERTED_JSON).write_text(json.dumps(info, indent=1) + "\n")
        os.replace(staging, out)
    dist.barrier()
    return info


def load_converted(directory: str | Path, model_chunks: list) -> None:
    """Load a `save_converted` directory into this rank's built chunks (any layout: dist_checkpointing
    reshards). Every parameter must be filled: a missing one raises naming it. Transformer Engine's
    `_extra_state` (FP8 metadata; none in a conversion made without TE) may be absent. Collective."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from .export import unwrap

    # "unexpected": asked for but not in the checkpoint (megatron's naming); returned, not raised
    loaded, _, unexpected = dist_checkpointing.load({"model": _model_request(model_chunks)}, str(directory),
                                                    strict=StrictHandling.RETURN_UNEXPECTED)
    absent = sorted(key for key in unexpected if not key.endswith("_extra_state"))
    if absent:
        raise RuntimeError(f"{directory}: the converted checkpoint lacks {len(absent)} tensor(s) this model needs: "
                           f"{absent[:5]}")
    for i, chunk in enumerate(model_chunks):
        result = unwrap(chunk).load_state_dict(loaded["model"][f"chunk{i}"], strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing or result.unexpected_keys:
            raise RuntimeError(f"{directory}: chunk {i} left {missing} unloaded, got {result.unexpected_keys} extra")


def convert_backbone(recipe, out: Path, tp: int, pp: int) -> dict:
    """`python -m recipes.convert` (the contract's `converter`): build this rank's share of the backbone at
    TP `tp` x PP `pp` from the HF checkpoint and save it (`save_converted`) into `out`. Collective over the
    world; returns what rank 0 prints."""
    # the layout of the conversion alone; the weights are the same under both layer specs (megatron saves
    # the local spec's norms under the TE spec's names), so the local spec converts for either
    layout = dataclasses.replace(recipe.megatron, tp_size=tp, pp_size=pp, virtual_pp_size=None,
                                 sequence_parallel=False, transformer_impl="local", load_converted=None)
    recipe = dataclasses.replace(recipe, megatron=layout)
    setup_distributed(recipe.train.dist_timeout_minutes)
    chunks = []
    try:
        initialize_model_parallel(recipe)
        chunks = build_model_chunks(recipe)
        info = save_converted(out, chunks, recipe, chunks[0].hf_config)
        read = [0] * dist.get_world_size()
        dist.all_gather_object(read, SafetensorsReader.bytes_read_in_process)
        return {"out": str(out), **info, "hf_bytes_read": sum(read)}
    finally:
        if chunks:
            release_model_parallel(chunks)
        teardown()
