"""The two engines on mixture-of-experts models: the same recipe's step 1 logs the same loss, CE, terms,
router/aux and gradient norm (1e-5 relative) on the DeepSpeed engine (ZeRO-2, DP 2: the HF model, every
expert on each rank) and on the Megatron engine at DP 2, at TP 1 / EP 2 (each rank holds half of the
experts) and at TP 2 with sequence parallelism (each rank routes half of the tokens), for the tiny Qwen3-MoE and Mixtral of `deepspeed/test_moe.py` (router_aux_loss_coef 0.3, rows with
right padding, which router/aux leaves out on both engines). Two gloo processes.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from recipes.engines.megatron.pure.support import MOE_MODEL_TYPES
from tests.distributed import run_ranks
from tests.recipes.engines.deepspeed.runtime.test_moe import FAMILIES as DEEPSPEED_FAMILIES, tiny

# the families both engines train (Qwen2-MoE's shared expert is DeepSpeed's only: the conversion refuses it)
FAMILIES = {name: config for name, config in DEEPSPEED_FAMILIES.items() if name in MOE_MODEL_TYPES}

if importlib.util.find_spec("megatron.core") is None:
    raise ImportError("tests/recipes/engines/test_moe_engines.py needs megatron-core (pip install -e '.[megatron]')")

# (name, engine, layout): every layout's micro-batches are the same pairs of rows (DP 2 x accumulation 2, or
# DP 1 x accumulation 4), so router/aux, the mean of the micro-batches' values, is the same number
LAYOUTS = [("deepspeed", "deepspeed", {}), ("megatron_dp2", "megatron", {}), ("megatron_ep2", "megatron", {"ep": 2}),
           ("megatron_tp2_sp", "megatron", {"tp": 2, "sp": True, "accum": 4})]


def _ranks(rank, world, assets, out):
    import torch.distributed as dist

    from megatron.core import parallel_state

    from recipes.engines.deepspeed.runtime.engine import DeepSpeedEngine
    from recipes.engines.megatron.runtime.engine import MegatronEngine
    from recipes.reliability.checkpoints import CheckpointDirs
    from tests.recipes.engines.megatron import engine_helpers as H

    runtime, out = H.gloo_rank_runtime(rank, world), Path(out)
    rows = {}
    for family in FAMILIES:
        for name, kind, layout in LAYOUTS:
            recipe = H.make_recipe({"tokenizer": assets["tokenizer"], "model": assets[family]}, micro=2, steps=1,
                                   tp=layout.get("tp", 1), sp=layout.get("sp", False), accum=layout.get("accum", 2))
            recipe.train.engine, recipe.deepspeed.zero_stage = kind, 2
            recipe.megatron.ep_size = layout.get("ep", 1)
            if kind == "deepspeed":
                engine = DeepSpeedEngine(recipe, runtime, CheckpointDirs(out / f"{family}_{name}", 1, runtime))
            else:
                engine = MegatronEngine(recipe, runtime)
            rows[f"{family}/{name}"] = H.run_steps(engine, assets, 1, 1)[0]
            engine.close()
            assert not parallel_state.model_parallel_is_initialized()
    if rank == 0:
        H.write(out / "rows.json", rows)
    dist.barrier()


@pytest.fixture(scope="module")
def engine_rows(tmp_path_factory):
    from tests.recipes.engines.megatron import engine_helpers as H

    root = tmp_path_factory.mktemp("moe_engines")
    tokenizer = H.digits_tokenizer(root)
    assets = {"tokenizer": str(root / "tokenizer")}
    for family in FAMILIES:
        tiny(family, pad_token_id=tokenizer.pad_token_id).save_pretrained(str(root / family))
        assets[family] = str(root / family)
    out = root / "out"
    out.mkdir()
    run_ranks(2, _ranks, assets, str(out), timeout=500)
    return H.read(out / "rows.json")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_step_one_equals_across_engines_and_layouts(engine_rows, family):
    reference = engine_rows[f"{family}/deepspeed"]
    assert reference["router/aux"] > 0.01 * reference["loss"] and reference["grad_norm"] > 0
    assert all(reference[k] > 1e-3 for k in reference if k.startswith("term/"))
    for name, _, _ in LAYOUTS[1:]:
        row = engine_rows[f"{family}/{name}"]
        for key, value in reference.items():
            if key in ("tokens_run", "lr"):
                continue
            assert row[key] == pytest.approx(value, rel=1e-5, abs=1e-12), f"{family} {name} {key}: {row[key]} != {value}"
