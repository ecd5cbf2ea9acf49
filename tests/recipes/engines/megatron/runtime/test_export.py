"""Export at TP 2 x PP 2 (4 gloo ranks, one spawn): a tied Llama and an untied Qwen2 with QKV bias, their
megatron weights perturbed (so an export of the untouched checkpoint could not pass), exported with
`export_hf` into a directory that already holds an older export. Checked on every rank:

- the directory is an ordinary sharded HF checkpoint (index + `model-0000i-of-0000N` shards, several per
  stage) that `AutoModelForCausalLM.from_pretrained` loads, nothing of the old export and no temporary
  directory is left;
- its weights, converted back for each (TP rank, PP rank), equal every rank's megatron weights
  bit for bit (vocabulary padding aside), and the tied model has no lm_head in the files;
- the loaded HF model's logits equal the TP 2 x PP 2 megatron model's (1e-5);
- `generation_config.json` is the backbone's: an Instruct-style one (two end-of-turn ids, sampling
  defaults) for the Llama, the one transformers derives from the config for the Qwen2, which has none.
"""

from __future__ import annotations

import importlib.util
import json
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

from tests.recipes.engines.megatron.helpers import VOCAB, recipe_for, run_ranks, save_tiny

if importlib.util.find_spec("megatron.core") is None:
    raise ImportError("tests/recipes/engines/megatron needs megatron-core (pip install -e '.[megatron]')")


def _perturb(chunks, tied: bool) -> None:
    """Add noise seeded by the global name (and the TP rank for split tensors), so replicated tensors stay
    replicated and the tied copies (embedding, last stage's output layer) stay equal."""
    from megatron.core import parallel_state

    from recipes.engines.megatron.runtime.convert import (
        global_layer_names,
        layer_range,
        tp_split_dim,
    )

    tp_rank, pp_rank = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    with torch.no_grad():
        for chunk in chunks:
            offset = layer_range(chunk.config, pp_rank, chunk.vp_stage).start
            params = global_layer_names(dict(chunk.named_parameters()), offset)
            for name, p in params.items():
                key = "embedding.word_embeddings.weight" if tied and name == "output_layer.weight" else name
                seed = zlib.crc32(f"{key}/{tp_rank if tp_split_dim(name) is not None else 0}".encode())
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.05)


def _export_and_check(rank, path, model_dir, kind):
    from megatron.core import parallel_state
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from recipes.engines.megatron.runtime.convert import (
        SafetensorsReader,
        hf_to_megatron,
    )
    from recipes.engines.megatron.runtime.export import export_hf
    from recipes.engines.megatron.runtime.model import (
        build_model_chunks,
        initialize_model_parallel,
    )
    from tests.recipes.engines.megatron.runtime.test_model import (
        B,
        S,
        _batch,
        _gather_vocab,
        _schedule_logits,
    )

    recipe = recipe_for(model_dir, tp=2, pp=2)
    initialize_model_parallel(recipe)
    chunks = build_model_chunks(recipe)
    tied = kind == "llama"
    _perturb(chunks, tied)
    if rank == 0:  # an older export in the way: it must be replaced whole
        path.mkdir()
        (path / "stale.safetensors").write_text("old")
    dist.barrier()
    info = export_hf(chunks, path, max_shard_bytes=40_000)

    files = sorted(p.name for p in path.iterdir())
    assert "stale.safetensors" not in files and not any(".tmp-export" in p.name or ".old-export" in p.name
                                                       for p in path.parent.iterdir())
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 4 and shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                                           for i in range(1, len(shards) + 1)]
    assert set(shards) <= set(files) and "config.json" in files
    source = Path(model_dir) / "generation_config.json"
    want = (GenerationConfig.from_pretrained(str(model_dir)) if source.is_file()
            else GenerationConfig.from_model_config(AutoConfig.from_pretrained(str(model_dir))))
    got = GenerationConfig.from_pretrained(str(path))
    assert got.to_diff_dict() == want.to_diff_dict(), (got, want)
    assert ("lm_head.weight" in index["weight_map"]) == (not tied)
    tp_rank, pp_rank = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    assert bool(info["keys"]) == (tp_rank == 0 and dp_rank == 0)  # one writer per stage

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()
    reader = SafetensorsReader(path)
    for name, t in hf.state_dict().items():  # transformers loaded exactly what was written
        if name in reader:
            assert torch.equal(t, reader(name)), name
    for chunk in chunks:
        config = chunk.config
        expected = hf_to_megatron(reader, config, hf.config, tp_rank=tp_rank, tp_size=2, pp_rank=pp_rank, pp_size=2,
                                  vp_stage=chunk.vp_stage)
        for name, p in chunk.named_parameters():
            want = expected[name]
            if name.endswith(("word_embeddings.weight", "output_layer.weight")):
                real = max(0, min(p.shape[0], VOCAB - tp_rank * p.shape[0]))  # padding rows are not exported
                p, want = p[:real], want[:real]
            assert torch.equal(p.detach(), want), f"rank {rank} {kind} {name}"

    ids, _ = _batch()
    with torch.no_grad():
        reference = hf(ids).logits
        local, _ = _schedule_logits(chunks, ids)
    if local is not None:
        full = _gather_vocab(local)
        assert full.shape[:2] == (B, S)
        torch.testing.assert_close(full[..., :VOCAB], reference, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"rank {rank} {kind} logits: {m}")
    parallel_state.destroy_model_parallel()


def _four_ranks(rank, world, llama_dir, qwen_dir, out):
    _export_and_check(rank, out / "llama-export", llama_dir, "llama")
    _export_and_check(rank, out / "qwen2-export", qwen_dir, "qwen2")


def test_export_tp2_pp2_loads_in_transformers(tmp_path):
    from transformers import GenerationConfig

    llama = save_tiny("llama", tmp_path / "llama")
    qwen = save_tiny("qwen2", tmp_path / "qwen2")
    # an Instruct model's generation defaults (end of turn and end of text, sampling) that an export must keep
    GenerationConfig(bos_token_id=1, eos_token_id=[2, 7], pad_token_id=0, do_sample=True, temperature=0.6,
                     top_p=0.9).save_pretrained(str(llama))
    (qwen / "generation_config.json").unlink(missing_ok=True)
    out = tmp_path / "exports"
    out.mkdir()
    run_ranks(4, _four_ranks, llama, qwen, out, timeout=420)


def _failing_exports(rank, world, model_dir, out):
    """PP 2 on 2 ranks (one writer per stage). Stage 1's disk fails mid-write, then rank 0's assembly:
    both times every rank raises the same error naming the failed rank, in seconds (the deadline of
    run_ranks is far below the process group's 60 min), and the older export at `path` is untouched.
    Then a plain export succeeds in the same process group: nobody was left inside a collective."""
    import pytest

    from recipes.engines.megatron.runtime.export import export_hf
    from recipes.reliability import export_writer
    from recipes.engines.megatron.runtime.model import build_model_chunks, initialize_model_parallel

    initialize_model_parallel(recipe_for(model_dir, pp=2))
    chunks = build_model_chunks(recipe_for(model_dir, pp=2))
    path = out / "export"
    if rank == 0:
        path.mkdir()
        (path / "previous.safetensors").write_text("the previous export")
    dist.barrier()

    real_flush, real_assemble = export_writer.ShardWriter.flush, export_writer._assemble

    def disk_full(self):
        raise OSError(28, "No space left on device")

    if rank == 1:
        export_writer.ShardWriter.flush = disk_full
    with pytest.raises(RuntimeError, match=r"writing the shards failed on 1 rank\(s\); rank 1: the disk is full: OSError: .*No space left.* free of .* on that filesystem"):
        export_hf(chunks, path, max_shard_bytes=40_000)
    export_writer.ShardWriter.flush = real_flush
    assert [p.name for p in path.iterdir()] == ["previous.safetensors"]

    if rank == 0:
        export_writer._assemble = lambda *a: (_ for _ in ()).throw(PermissionError("read-only file system"))
    with pytest.raises(RuntimeError, match=r"assembling the export failed on 1 rank\(s\); rank 0: PermissionError"):
        export_hf(chunks, path, max_shard_bytes=40_000)
    export_writer._assemble = real_assemble
    assert [p.name for p in path.iterdir()] == ["previous.safetensors"]

    info = export_hf(chunks, path, max_shard_bytes=40_000)
    assert info["keys"] and (path / "model.safetensors.index.json").exists()
    assert not (path / "previous.safetensors").exists()
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def test_a_failed_export_fails_every_rank_at_once(tmp_path):
    llama = save_tiny("llama", tmp_path / "llama")
    out = tmp_path / "exports"
    out.mkdir()
    run_ranks(2, _failing_exports, llama, out, timeout=180)
