"""The sharded Hugging Face export (recipes.engines.deepspeed.runtime.export) at ZeRO-0/2/3 with TP 1 and 2 on 2 real gloo ranks.

Per layout: a tiny Llama (vocab 101: AutoTP splits the lm_head 51 + 50; at TP 1 with tied
embeddings, written once) is loaded from a saved
directory through `recipes.engines.deepspeed.runtime.model.build_model`, wrapped as in training, given one optimizer step on a
fixed batch, and exported. Checked: every rank wrote its own shard (2 files + transformers' index),
each rank held at most half the bytes plus one module, the directory loads with
`AutoModelForCausalLM.from_pretrained`, and its weights equal DeepSpeed's own consolidation on rank 0
(`_consolidated_16bit_state_dict` under ZeRO-3 or AutoTP, `module.state_dict()` otherwise) exactly,
and differ from the starting weights (the step happened). ZeRO-2 with TP 2 is among them: DeepSpeed's
`_zero3_consolidated_16bit_state_dict` raises there, after the whole run, so the export must not call it.

One spawn of 2 ranks per TP size; the three ZeRO stages share it (one engine after another).
Not simulated: host-RAM savings on a GPU node and storage bandwidth (no CPU test can measure them).

A failed export is atomic: on 2 real gloo ranks a tiny Llama is exported to `final/`, its weights are
changed, and the second export fails on rank 1 only (the shard write raises, as a full disk would). Every
rank raises (none waits in a collective), `final/` is still the first export file for file and loads as
it, no staging directory is left; then a good export replaces it whole. A writer that swapped files in
place would leave the old index and config with a mix of old and new shards, which `from_pretrained`
loads without error.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_ranks

pytestmark = pytest.mark.timeout(600)
V = 101


def _save_source(root: Path) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from recipes.experiments.tiny import train_tokenizer

    train_tokenizer(["0123456789 + - = ."], root / "tok", "digits")
    for name, tied in (("source", False), ("source-tied", True)):
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             tie_word_embeddings=tied)
        AutoModelForCausalLM.from_config(config).save_pretrained(root / name)
    return root


def _rank(rank, world, root: str, tp: int):
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    from recipes.engines.deepspeed.runtime.distributed import skip_cpu_shm_op
    from recipes.training.runtime import Runtime

    skip_cpu_shm_op()
    import deepspeed
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from numloss import NumericVocab, Objective
    from recipes.config import recipe_from_dict
    from recipes.engines.deepspeed.pure.config import deepspeed_config
    from recipes.engines.deepspeed.runtime.export import export_model
    from recipes.engines.deepspeed.runtime.model import build_model, training_module

    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
    root = Path(root)
    runtime = Runtime(rank, world, rank, torch.device("cpu"))
    tokenizer = AutoTokenizer.from_pretrained(root / "tok")
    # TP 1 exports a model with tied embeddings (Qwen2.5-1.5B's layout): the shared weight is written once
    name = "source-tied" if tp == 1 else "source"
    source = AutoModelForCausalLM.from_pretrained(root / name).state_dict()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(V, (2, 12), generator=g)
    for stage in (0, 2, 3):
        recipe = recipe_from_dict({
            "model": {"name_or_path": str(root / name), "tokenizer": str(root / "tok"), "dtype": "float32",
                      "attn_implementation": "eager"},
            "data": {"train": "unused"}, "loss": {"objective": {"terms": {"smmd": {}}}, "head": "logits"},
            "deepspeed": {"zero_stage": stage, "tp_size": tp},
            "train": {"micro_batch_size": 2, "grad_accum": 1, "out_dir": str(root / "unused")}})
        ds_config = deepspeed_config(recipe, world)
        ds_config.pop("train_batch_size")  # DeepSpeed derives it (its count under AutoTP: deepspeed/config.py)
        model, live = build_model(recipe, ds_config, runtime.device)
        vocab = NumericVocab(list(range(3, 13)), list(range(10)), vocab_size=V)
        wrapper = training_module(model, Objective(vocab, {"terms": {"smmd": {}}}), recipe)
        optimizer = torch.optim.AdamW(wrapper.parameters(), lr=1e-2)
        engine, *_ = deepspeed.initialize(model=wrapper, optimizer=optimizer, config=ds_config)
        del live
        try:
            out = engine(input_ids=ids, labels=ids)
            engine.backward(out.loss)
            engine.step()
            if stage == 3 or tp > 1:
                full = engine._consolidated_16bit_state_dict()
            else:
                full = engine.module.state_dict()
            path = root / f"export-z{stage}-tp{tp}"
            info = export_model(engine, model, tokenizer, path, runtime, zero_stage=stage, tp_size=tp)
            mine = [info]
            everyone = [None] * world
            dist.all_gather_object(everyone, mine[0])
            if rank == 0:
                if engine.module is not model:  # NumericCausalLM: the HF model is `.model`
                    full = {k[len("model."):]: v for k, v in full.items() if k.startswith("model.")}
                if tp == 1:
                    full.pop("lm_head.weight", None)  # the tied copy of model.embed_tokens.weight
                total = sum(v.numel() * v.element_size() for v in full.values())
                largest = max(v.numel() * v.element_size() for v in full.values())
                index = json.loads((path / "model.safetensors.index.json").read_text())
                files = sorted(p.name for p in path.glob("*.safetensors"))
                assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"], files
                assert sorted({e["file"] for e in everyone}) == files  # each rank wrote one of them
                for e in everyone:
                    assert e["bytes"] <= total / 2 + largest, (e["bytes"], total)
                on_disk = set(index["weight_map"])
                assert index["metadata"]["total_size"] == total and on_disk == set(full)
                if tp == 1:
                    assert "lm_head.weight" not in on_disk and "model.embed_tokens.weight" in on_disk
                loaded = AutoModelForCausalLM.from_pretrained(path).state_dict()
                assert set(loaded) == set(source)
                if tp == 1:
                    assert loaded["lm_head.weight"].data_ptr() == loaded["model.embed_tokens.weight"].data_ptr()
                for key, value in full.items():
                    assert torch.equal(loaded[key], value), f"z{stage} tp{tp} {key}"
                moved = [k for k in source if not torch.equal(loaded[k], source[k])]
                assert "lm_head.weight" in moved and len(moved) > len(source) // 2, moved
                assert AutoTokenizer.from_pretrained(path).get_vocab() == tokenizer.get_vocab()
            dist.barrier()
        finally:
            engine.destroy()


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return _save_source(tmp_path_factory.mktemp("export"))


@pytest.mark.parametrize("tp", [1, 2])
def test_sharded_export_at_zero_0_2_3_equals_the_consolidated_weights(source, tp):
    run_ranks(2, _rank, str(source), tp)


def _failing_exports(rank, world, root: str):
    os.environ.update(DS_ACCELERATOR="cpu")
    from recipes.engines.deepspeed.runtime.distributed import skip_cpu_shm_op
    from recipes.training.runtime import Runtime

    skip_cpu_shm_op()
    import safetensors.torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from recipes.engines.deepspeed.runtime.export import export_model
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
    assert f"the previous {final} is unchanged" in message and "rank 1: the disk is full: OSError" in message, message
    assert "free of " in message and "on that filesystem (" in message, message
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
    run_ranks(2, _failing_exports, str(tmp_path))
