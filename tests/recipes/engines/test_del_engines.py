"""`loss.objective.terms.del` in a recipe, with no other key (the decimal point comes from the tokenizer):
step 1 on the DeepSpeed engine (ZeRO-2) and on the Megatron engine (TP 1) logs `term/del` equal to the
float64 reference of DEL on a Hugging Face forward of the same weights and rows, and loss = CE + 0.01 x
DEL. One gloo process (the engines' tiny Llama and digits tokenizer of
tests/recipes/engines/megatron/engine_helpers.py). A recipe whose numeric policy cannot serve DEL:
tests/recipes/checks/test_objective_checks.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.distributed import run_ranks
from tests.numloss import numeric_reference as R

ENGINES = ["deepspeed"] + (["megatron"] if importlib.util.find_spec("megatron.core") else [])


def _recipe(assets: dict, engine: str):
    from recipes.config import recipe_from_dict

    return recipe_from_dict({
        "name": "del-test",
        "model": {"name_or_path": assets["model"], "tokenizer": assets["tokenizer"], "dtype": "float32"},
        "data": {"train": "unused"},
        "optim": {"lr": 1e-3, "warmup_steps": 1},
        "deepspeed": {"zero_stage": 2},
        "megatron": {"distributed_optimizer": False},
        "train": {"engine": engine, "steps": 1, "micro_batch_size": 2, "grad_accum": 4, "out_dir": "unused",
                  "export": False},
    }, ["loss.objective={terms: {del: {}}}"])


def _ranks(rank, world, assets, out):
    import torch.distributed as dist

    from recipes.reliability.checkpoints import CheckpointDirs
    from tests.recipes.engines.megatron import engine_helpers as H

    runtime, out = H.gloo_rank_runtime(rank, world), Path(out)
    rows = {}
    for kind in ENGINES:
        recipe = _recipe(assets, kind)
        if kind == "deepspeed":
            from recipes.engines.deepspeed.runtime.engine import DeepSpeedEngine

            engine = DeepSpeedEngine(recipe, runtime, CheckpointDirs(out / kind, 1, runtime))
        else:
            from recipes.engines.megatron.runtime.engine import MegatronEngine

            engine = MegatronEngine(recipe, runtime)
        rows[kind] = H.run_steps(engine, assets, 1, 1)[0]
        engine.close()
    H.write(out / "rows.json", rows)
    dist.barrier()


def _reference(assets: dict) -> float:
    """DEL of step 1's global batch, from the definition (float64 loops) on the HF model's logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.recipes.engines.megatron import engine_helpers as H

    tok = AutoTokenizer.from_pretrained(assets["tokenizer"])
    model = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32)
    rows = H.global_batch(1, assets["tokenizer"])
    batch = {k: torch.stack([row[k] for row in rows]) for k in rows[0]}
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double()
    digits = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
    return float(R.digit_entropy(logits[:, :-1], batch["labels"][:, 1:], digits, tok.convert_tokens_to_ids(".")))


@pytest.mark.timeout(600)
def test_del_in_a_recipe_on_both_engines(tmp_path):
    from tests.recipes.engines.megatron import engine_helpers as H

    assets = H.make_assets(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    run_ranks(1, _ranks, assets, str(out), timeout=540)
    rows = H.read(out / "rows.json")
    want = _reference(assets)
    assert want > 0
    for kind, row in rows.items():
        assert row["term/del"] == pytest.approx(want, rel=1e-5), (kind, row["term/del"], want)
        assert row["loss"] == pytest.approx(row["ce"] + 0.01 * row["term/del"], rel=1e-6), kind
    assert set(rows) == set(ENGINES)
