"""Export a trained megatron-core GPTModel as an ordinary Hugging Face safetensors directory.

Contract (`export_hf`):
- A collective: every rank of the default group calls it, with its own model chunks (one per virtual
  pipeline stage, wrapped or not in megatron's DDP / Float16Module) built by `build_gpt_model`.
- Only data-parallel rank 0's copy is read (DP replicas hold the same weights). Within it, each TP
  group gathers its stage's tensors to its TP rank 0, one tensor at a time (`dist.gather`), and that
  rank converts them to HF names and shapes (`convert.megatron_to_hf`: QKV de-interleaved, `[gate_r;
  up_r]` split, vocabulary padding dropped, the tied output copy dropped) and writes its own shard
  files, starting a new file past `max_shard_bytes`. So one rank per pipeline stage writes, and no rank
  ever holds more than its stage's share of the model (at 70B, PP 8, bf16: ~18 GB) plus one full tensor.
- The one export writer (`recipes.reliability.export_writer`) does the rest, as for the DeepSpeed engine:
  the shards go into a staging directory beside the target, fsynced; rank 0 numbers them (pipeline
  order), writes `model.safetensors.index.json`, `config.json` (the original HF config, dtype set to the
  export's), `generation_config.json` (the backbone's, as transformers loaded it: an Instruct model's
  end-of-turn ids and sampling defaults), the tokenizer and the record of what the export holds, fsyncs
  them and switches the directory in atomically. A crash mid-export leaves the previous export, or
  nothing, at `path`, never a partial one.
- A failure on one rank fails every rank, promptly: the writer ends each step that can fail locally in an
  agreement (an all-gather of each rank's error) instead of a barrier, and a writer whose disk failed
  keeps joining its TP group's gathers without writing. Every rank then raises the same RuntimeError
  naming the failed ranks, where it would otherwise wait in the next collective until the process
  group's timeout (60 min by default).
- MoE (`moe.py`): an expert's weights live on one expert-parallel rank, which is a data-parallel rank;
  they are read from expert-data-parallel rank 0 of each EP rank (so the DP ranks 0 .. ep-1 read
  experts), gathered over the experts' TP group, numbered globally and written by that TP group's rank
  0 into its own files (`stage-P-epE-*`); the dense tensors are DP rank 0's as above.
- Returns the HF keys this rank wrote and their bytes: {"keys": [...], "bytes": n} (empty on ranks that
  write nothing).
`transformers.AutoModelForCausalLM.from_pretrained(path)` loads the result.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist

from recipes.reliability.export_writer import ExportRecord, HFFiles, Shard, ShardWriter, write_export

from .convert import global_layer_names, layer_range, megatron_to_hf, tp_split_dim
from .moe import global_expert_names, is_expert_param

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


def unwrap(model):
    """The GPTModel inside megatron's DDP / Float16Module wrappers (each keeps it as `.module`)."""
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    return model


def _chunk_tensors(chunk) -> dict[str, torch.Tensor]:
    """A chunk's weights with global layer numbers (no `_extra_state`)."""
    from megatron.core import parallel_state

    offset = layer_range(chunk.config, parallel_state.get_pipeline_model_parallel_rank(), chunk.vp_stage).start
    state = {k: v for k, v in chunk.state_dict().items()
             if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    if chunk.config.num_moe_experts:
        ep = parallel_state.get_expert_model_parallel_world_size()
        state = global_expert_names(state, parallel_state.get_expert_model_parallel_rank(),
                                    chunk.config.num_moe_experts // ep)
    return global_layer_names(state, offset)


def export_hf(model_chunks, path: str | Path, hf_config=None, *, dtype: torch.dtype | None = None,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, generation_config=None, tokenizer=None,
              record: ExportRecord | None = None) -> dict:
    """Write the HF export of a GPTModel trained under any TP x PP (x VP) x DP layout; see the module
    docstring for the contract. `model_chunks`: this rank's chunk or list of chunks; `hf_config` and
    `generation_config`: the backbone's (default: the ones `build_gpt_model` attached to the chunk; no
    generation_config.json when neither is there); `dtype`: the tensors' dtype on disk (default: the
    model's); `tokenizer`: saved inside the export; `record`: what the export says it holds."""
    from megatron.core import parallel_state

    chunks = [unwrap(c) for c in (model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks])]
    hf_config = hf_config if hf_config is not None else getattr(chunks[0], "hf_config", None)
    if hf_config is None:
        raise ValueError("export_hf: no hf_config given and the model has none attached")
    generation_config = generation_config or getattr(chunks[0], "generation_config", None)
    config = chunks[0].config
    dtype = dtype or config.params_dtype
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp_rank, tp_size = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
    tp_src = parallel_state.get_tensor_model_parallel_src_rank()
    reads = parallel_state.get_data_parallel_rank() == 0
    writes = reads and tp_rank == 0
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    moe = bool(config.num_moe_experts)
    reads_experts = moe and parallel_state.get_expert_data_parallel_rank() == 0
    expert_tp_group = parallel_state.get_expert_tensor_parallel_group() if moe else None
    expert_tp_src = dist.get_global_rank(expert_tp_group, 0) if moe else None
    writes = writes or (reads_experts and parallel_state.get_expert_tensor_parallel_rank() == 0)
    ep_part = f"-ep{parallel_state.get_expert_model_parallel_rank():04d}" if moe else ""

    def write_shards(staging: Path) -> list[Shard]:
        """This rank's stage: gathered over its TP group, converted, written by its TP rank 0."""
        writer = ShardWriter(staging, f"stage-{pp_rank:04d}{ep_part}", max_shard_bytes) if writes else None
        error = None
        if reads or reads_experts:
            for chunk in chunks:
                for name, tensor in _chunk_tensors(chunk).items():
                    # every TP rank of the group walks the same names in the same order (same layers); an
                    # expert is read from its EP rank's expert-DP rank 0, the rest from DP rank 0
                    expert = moe and is_expert_param(name)
                    if not (reads_experts if expert else reads):
                        continue
                    group, src = (expert_tp_group, expert_tp_src) if expert else (tp_group, tp_src)
                    if tp_split_dim(name) is None or tp_size == 1:
                        shards = [tensor]
                    else:
                        shards = [torch.empty_like(tensor) for _ in range(tp_size)] if writes else None
                        dist.gather(tensor.contiguous(), shards, dst=src, group=group)
                    if writes and error is None:  # after a failed write: keep gathering, stop writing
                        try:
                            for hf_name, hf_tensor in megatron_to_hf({name: shards}, config, hf_config).items():
                                writer.add(hf_name, hf_tensor.to(dtype))
                        except Exception as e:  # noqa: BLE001  (raised below, once the gathers are done)
                            error = e
                    del shards
        if error is not None:
            raise error
        if writer is None:
            return []
        writer.flush()
        return writer.shards

    out_config = copy.deepcopy(hf_config)
    out_config.dtype = dtype
    mine = write_export(path, write_shards, HFFiles(out_config, generation_config, tokenizer), record,
                        what="export_hf")
    return {"keys": sorted(k for shard in mine for k in shard.keys), "bytes": sum(shard.bytes for shard in mine)}
