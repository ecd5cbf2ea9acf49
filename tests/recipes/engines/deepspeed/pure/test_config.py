"""recipes.engines.deepspeed.pure.config: `deepspeed.overrides` that contradict a recipe key the engine reads
itself are refused when the recipe loads, naming both keys; overrides that refine what the keys say are
merged as they are."""

from __future__ import annotations

import pytest

from recipes.config import recipe_from_dict
from recipes.engines import ENGINES
from recipes.engines.deepspeed.pure.config import deepspeed_config

BASE = {"model": {"config": {"model_type": "llama"}, "tokenizer": "tok", "dtype": "bfloat16"},
        "data": {"train": "data"}, "deepspeed": {"zero_stage": 3}}


@pytest.mark.parametrize("overrides, message", [
    (["deepspeed.overrides={zero_optimization: {stage: 2}}"],
     "deepspeed.overrides.zero_optimization.stage: 2 contradicts deepspeed.zero_stage: 3 (read by the engine's "
     "checkpoint layout, the export's gathers and the memory plan): set deepspeed.zero_stage instead"),
    (["deepspeed.overrides={tensor_parallel: {autotp_size: 2}}"],
     "deepspeed.overrides.tensor_parallel.autotp_size: 2 contradicts deepspeed.tp_size: 1"),
    (["deepspeed.overrides={communication_data_type: bf16}"],
     'deepspeed.overrides.communication_data_type: "bf16" contradicts deepspeed.reduce_dtype: "fp32"'),
    (["deepspeed.overrides={gradient_accumulation_steps: 4}", "train.grad_accum=2"],
     "deepspeed.overrides.gradient_accumulation_steps: 4 contradicts train.grad_accum: 2"),
    (["deepspeed.overrides={train_micro_batch_size_per_gpu: 4}"],
     "deepspeed.overrides.train_micro_batch_size_per_gpu: 4 contradicts train.micro_batch_size: 1"),
    (["deepspeed.overrides={gradient_clipping: 0.5}"],
     "deepspeed.overrides.gradient_clipping: 0.5 contradicts optim.grad_clip: 1.0"),
    (["deepspeed.overrides={bf16: {enabled: false}}"],
     'deepspeed.overrides.bf16.enabled: false contradicts model.dtype: "bfloat16", which sets true there'),
    (["deepspeed.overrides={fp16: {enabled: true}}"],
     'deepspeed.overrides.fp16.enabled: true contradicts model.dtype: "bfloat16", which sets false there'),
    (["deepspeed.overrides={zero_optimization: {offload_optimizer: {device: cpu}}}"],
     'deepspeed.overrides.zero_optimization.offload_optimizer: {"device": "cpu"} offloads the optimizer state, '
     "while deepspeed.offload_optimizer is false"),
    (["deepspeed.offload_params=true", "deepspeed.overrides={zero_optimization: {offload_param: {device: none}}}"],
     'deepspeed.overrides.zero_optimization.offload_param: {"device": "none"} keeps the parameters on the GPU, '
     "while deepspeed.offload_params is true"),
    (["deepspeed.offload_optimizer=true", "deepspeed.overrides={zero_optimization: {offload_optimizer: null}}"],
     "deepspeed.overrides.zero_optimization.offload_optimizer: null keeps the optimizer state on the GPU"),
    (["deepspeed.overrides={zero_optimization: null}"],
     "deepspeed.overrides.zero_optimization: null is not a mapping"),
    (["deepspeed.overrides={train_batch_size: 8}"], "deepspeed.overrides.train_batch_size: it is derived"),
    (["deepspeed.overrides={optimizer: {type: Adam}}"],
     "deepspeed.overrides.optimizer: the optim section sets the optimizer"),
    (["deepspeed.overrides={scheduler: {type: WarmupLR}}"],
     "deepspeed.overrides.scheduler: the optim section sets the LR schedule"),
])
def test_an_override_that_contradicts_a_key_the_engine_reads_is_refused_when_the_recipe_loads(overrides, message):
    with pytest.raises(ValueError) as err:
        recipe_from_dict(BASE, overrides)
    assert message in str(err.value)


def test_the_refused_stage_is_the_one_deepspeed_would_run():
    """What the refusal prevents, computed from the config the engine hands DeepSpeed: the overrides are
    merged last, so DeepSpeed would run their stage while the engine decides by deepspeed.zero_stage."""
    recipe = recipe_from_dict(BASE)
    recipe.deepspeed.overrides = {"zero_optimization": {"stage": 2}}  # past the load-time check
    assert deepspeed_config(recipe, 1)["zero_optimization"]["stage"] == 2 != recipe.deepspeed.zero_stage


@pytest.mark.parametrize("overrides", [
    ["deepspeed.overrides={zero_optimization: {stage: 3, overlap_comm: false, reduce_bucket_size: 1000}}"],
    ["deepspeed.offload_optimizer=true",
     "deepspeed.overrides={zero_optimization: {offload_optimizer: {device: nvme, nvme_path: /nvme}}}"],
    ["deepspeed.overrides={zero_optimization: {offload_param: {pin_memory: true}}}"],  # no device: not offloaded
    ["deepspeed.overrides={tensor_parallel: {autotp_size: 1}, bf16: {enabled: true}, fp16: {enabled: false}}"],
    ["deepspeed.overrides={communication_data_type: fp32, gradient_clipping: 1.0, gradient_accumulation_steps: 1}"],
    ["model.dtype=float32", "deepspeed.overrides={communication_data_type: bf16}"],  # not set from the key there
])
def test_an_override_that_refines_what_the_keys_say_is_merged(overrides):
    recipe = recipe_from_dict(BASE, overrides)
    config = deepspeed_config(recipe, 1)
    assert config["zero_optimization"]["stage"] == recipe.deepspeed.zero_stage


def test_an_override_the_adopted_settings_contradict_is_refused():
    """megatron.distributed_optimizer: false maps onto ZeRO-0; the overrides' stage 3 agreed with the
    recipe as written and contradicts it once adopted: the adoption says so (exit 2)."""
    recipe = recipe_from_dict(BASE, ["deepspeed.overrides={zero_optimization: {stage: 3}}",
                                     "megatron.distributed_optimizer=false"])
    errors, _ = ENGINES["deepspeed"].adopt_settings(recipe)
    assert any("deepspeed.overrides.zero_optimization.stage: 3 contradicts deepspeed.zero_stage: 0" in e
               for e in errors), errors
