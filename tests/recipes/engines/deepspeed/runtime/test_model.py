"""A recipe with deepspeed.tp_size 2 on a model with fewer KV heads (1) than the TP size: the module
recipes.train hands DeepSpeed (recipes.engines.deepspeed.runtime.model.training_module) gives AutoTP the HF model's config and
tp_plan, and the numeric loss equals the single-process TP-1 loss, before and after one AdamW step,
on 2 real gloo ranks (TP 2, data parallel 1) at ZeRO-2 (AutoTP's documented stage). At ZeRO-3 the
rank without attention heads holds empty parameters that ZeRO-3 cannot partition (DeepSpeed 0.19.8
fails at the first forward, seen here): recipes.validation.validate and recipes.engines.deepspeed.runtime.model refuse that layout first.

Before the fix DeepSpeed received the NumericCausalLM wrapper, which has no `config`, `tp_plan` or
`loss_function`: DeepSpeed 0.19.8 refuses a vocab-parallel head on it ("requires a writable
loss_function hook"); given the config, it would still split `model.lm_head` by KV heads (it knows the
head by the name `lm_head`) and leave rank 1 without vocabulary.

And the attention implementation a built model reports, in the log (a real fall-back from
flash_attention_2 on a GPU without flash-attn is not reachable on CPU: the log line is what is checked).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.distributed import run_ranks

pytestmark = pytest.mark.timeout(400)
V = 101  # odd: the vocab-parallel head splits 51 + 50
LR = 1e-2


def _recipe(root: Path, stage: int, tp: int, head: str = "logits"):
    from recipes.config import recipe_from_dict

    return recipe_from_dict({
        "model": {"name_or_path": str(root / "source"), "tokenizer": str(root / "source"), "dtype": "float32",
                  "attn_implementation": "eager"},
        "data": {"train": "unused"}, "loss": {"objective": {"terms": {"smmd": {}, "ntl_was": {}}}, "head": head},
        "optim": {"lr": LR, "grad_clip": 0.0, "betas": [0.9, 0.95]},
        "deepspeed": {"zero_stage": stage, "tp_size": tp},
        "train": {"micro_batch_size": 2, "grad_accum": 1, "out_dir": str(root / "unused")}})


def _objective():
    from numloss import NumericVocab, Objective

    return Objective(NumericVocab([3, 11, 24, 38, 47, 52, 60, 77, 85, 99], [5, 0, 9, 1, 4, 7, 2, 8, 6, 3],
                                  vocab_size=V), {"terms": {"smmd": {}, "ntl_was": {}}})


def _batch():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(V, (2, 12), generator=g)
    ids[0, 3:6] = torch.tensor([11, 24, 99])
    ids[1, 7:9] = torch.tensor([52, 3])
    return ids


def _reference(root: Path) -> list[float]:
    """Single process, no DeepSpeed: the loss, one AdamW step, the loss again."""
    from transformers import AutoModelForCausalLM

    from numloss.adapters.hf import NumericCausalLM

    model = AutoModelForCausalLM.from_pretrained(root / "source", attn_implementation="eager")
    wrapper = NumericCausalLM(model, _objective(), chunked=False)
    opt = torch.optim.AdamW(wrapper.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    ids = _batch()
    first = wrapper(input_ids=ids, labels=ids).loss
    first.backward()
    opt.step()
    with torch.no_grad():
        second = wrapper(input_ids=ids, labels=ids).loss
    return [first.item(), second.item()]


def _rank(rank, world, root: str, stages: tuple, expected: list):
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    from recipes.engines.deepspeed.runtime.distributed import skip_cpu_shm_op

    skip_cpu_shm_op()
    import deepspeed

    from recipes.engines.deepspeed.pure.config import deepspeed_config
    from recipes.engines.deepspeed.runtime.optimizer import build_optimizer
    from recipes.engines.deepspeed.runtime.model import build_model, training_module

    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
    root = Path(root)
    ids = _batch()
    for stage in stages:
        recipe = _recipe(root, stage, tp=world)
        ds_config = deepspeed_config(recipe, world)
        ds_config.pop("train_batch_size")  # DeepSpeed derives it (its count under AutoTP: deepspeed/config.py)
        model, live = build_model(recipe, ds_config, torch.device("cpu"))
        wrapper = training_module(model, _objective(), recipe)
        assert wrapper is model and wrapper.config.num_key_value_heads == 1
        engine, *_ = deepspeed.initialize(model=wrapper, optimizer=build_optimizer(recipe, wrapper.parameters())[0],
                                          config=ds_config)
        del live
        try:
            head = engine.module.lm_head
            assert type(head).__name__ == "VocabParallelLinear"
            assert (head.weight.ds_shape if hasattr(head.weight, "ds_shape") else head.weight.shape)[0] == \
                (51, 50)[rank]  # every rank holds part of the vocabulary
            first = engine(input_ids=ids, labels=ids).loss
            engine.backward(first)
            engine.step()
            with torch.no_grad():
                second = engine(input_ids=ids, labels=ids).loss
            got = [first.item(), second.item()]
            assert got == pytest.approx(expected, rel=2e-5, abs=1e-6), (stage, rank, got, expected)
        finally:
            engine.destroy()


def test_kv_heads_fewer_than_tp_size_match_tp1(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "source")
    expected = _reference(tmp_path)
    assert expected[1] < expected[0]  # the step did something the comparison can see
    run_ranks(2, _rank, str(tmp_path), (2,), expected)


def test_zero3_with_fewer_kv_heads_than_tp_is_refused_before_launch(tmp_path):
    import yaml

    from recipes.validation import validate
    from recipes.engines.deepspeed.runtime.model import training_module

    model = {"model_type": "llama", "vocab_size": V, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"model": {"config": model, "tokenizer": "t"}, "data": {"train": "d"},
                                    "deepspeed": {"zero_stage": 3, "tp_size": 2},
                                    "cluster": {"nodes": 1, "gpus_per_node": 2}}))
    rep = validate.validate_recipe(path, offline=True)
    assert any(e.startswith("deepspeed.tp_size: the model has 1 KV heads, fewer than tp_size 2") for e in rep.errors)
    ok = validate.validate_recipe(path, ["deepspeed.zero_stage=2"], offline=True)
    assert not any(e.startswith("deepspeed.tp_size") for e in ok.errors)
    assert any("attention runs on 1 of the 2 TP ranks" in w for w in ok.warnings)

    from transformers import AutoConfig

    class Stub(torch.nn.Module):
        config = AutoConfig.for_model(**model)

    with pytest.raises(ValueError, match="use deepspeed.zero_stage 2"):
        training_module(Stub(), _objective(), _recipe(tmp_path, 3, tp=2))


def test_the_attention_actually_used_is_logged(capsys):
    from recipes.config import recipe_from_dict
    from recipes.engines.deepspeed.runtime.model import build_model, log_attention
    from recipes.experiments.tiny import tiny_llama_config

    base = {"model": {"config": tiny_llama_config(64, hidden=16, layers=1, heads=2, kv_heads=1), "tokenizer": "t",
                      "dtype": "float32"}, "data": {"train": "d"}, "deepspeed": {"zero_stage": 0}}
    recipe = recipe_from_dict(base, ["model.attn_implementation=eager"])
    config = {"zero_optimization": {"stage": 0}}
    model, _ = build_model(recipe, config, torch.device("cpu"))
    assert capsys.readouterr().out.strip() == "[numloss] attention implementation: eager"
    model, _ = build_model(recipe_from_dict(base), config, torch.device("cpu"))  # default on CPU: sdpa
    assert capsys.readouterr().out.strip() == "[numloss] attention implementation: sdpa"
    assert log_attention(model, "flash_attention_2") == "sdpa"
    assert "(asked for flash_attention_2: WARNING, transformers fell back)" in capsys.readouterr().out
