"""Issue 27: the export is atomic. On 2 real gloo ranks a tiny Llama is exported to `final/`, its weights
are changed, and the second export fails on rank 1 only (the shard write raises, as a full disk would).
Every rank raises (none waits in a collective), `final/` is still the first export file for file and
loads as it, no staging directory is left; then a good export replaces it whole. Before, the old index
and config stayed with a mix of old and new shards, and `from_pretrained` loaded that without error."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.distributed import run_ranks

pytestmark = pytest.mark.timeout(600)


def _rank(rank, world, root: str):
    os.environ.update(DS_ACCELERATOR="cpu")
    from recipes.training.runtime import Runtime, _skip_cpu_shm_op

    _skip_cpu_shm_op()
    import safetensors.torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from recipes.engines.deepspeed.export import export_model
    from recipes.reliability.export_writer import staging_dir

    root = Path(root)
    runtime = Runtime(rank, world, rank, torch.device("cpu"))
    tokenizer = AutoTokenizer.from_pretrained(root / "tok")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                                         num_hidden_layers=2, num_attention_heads=2,
                                                         num_key_value_heads=1, max_position_embeddings=32))
    engine = SimpleNamespace(module=model)  # ZeRO-0, TP 1: the export reads the module as it is
    final = root / "final"

    def export():
        return export_model(engine, model, tokenizer, final, runtime, zero_stage=0, tp_size=1)

    export()
    first = {p.name: p.read_bytes() for p in final.iterdir()}
    assert "model.safetensors.index.json" in first and len([n for n in first if n.endswith(".safetensors")]) == 2
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    save_file = safetensors.torch.save_file
    if rank == 1:
        def full_disk(*args, **kwargs):
            raise OSError(28, "No space left on device (injected)")
        safetensors.torch.save_file = full_disk
    with pytest.raises(RuntimeError) as err:
        export()
    message = str(err.value)
    assert f"the previous {final} is unchanged" in message and "rank 1: OSError" in message, message
    torch.distributed.barrier()
    assert {p.name: p.read_bytes() for p in final.iterdir()} == first  # file for file: the first export
    assert not staging_dir(final).exists()
    if rank == 0:
        loaded = AutoModelForCausalLM.from_pretrained(final).state_dict()
        assert not torch.equal(loaded["lm_head.weight"], model.lm_head.weight)  # the old weights, not a mix
    safetensors.torch.save_file = save_file
    torch.distributed.barrier()

    export()  # a good export replaces the whole directory
    if rank == 0:
        loaded = AutoModelForCausalLM.from_pretrained(final).state_dict()
        for name, value in model.state_dict().items():
            assert torch.equal(loaded[name], value), name
        assert not staging_dir(final).exists() and not (root / ".final.old").exists()


def test_a_failed_export_leaves_the_previous_final_intact(tmp_path):
    from recipes.experiments.tiny import train_tokenizer

    train_tokenizer(["0123456789 + - = ."], tmp_path / "tok", "digits")
    run_ranks(2, _rank, str(tmp_path))
