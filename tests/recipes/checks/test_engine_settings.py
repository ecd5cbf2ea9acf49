"""recipes.checks.engine_settings: a setting the recipe's engine would ignore is refused naming the key, or
adopted onto the engine's own setting with a line for the log, before any model is built (docs/reliability.md,
"Settings the engine ignores"): DeepSpeed's optimizer offload and a Hugging Face attention kernel on
Megatron are refused; Megatron's selective recomputation on DeepSpeed is refused (no Hugging Face
equivalent); full recomputation and gradient checkpointing are mapped onto each other.
"""

from __future__ import annotations

from recipes.checks import preflight as checks
from tests.recipes.checks.helpers import llama3_recipe, refused


def test_settings_the_engine_would_ignore_are_refused_or_mapped(llama3_data):
    message = refused(llama3_data, llama3_recipe(llama3_data, "train.engine=megatron",
                                                 "deepspeed.offload_optimizer=true", "model.attn_implementation=sdpa"))
    assert "deepspeed.offload_optimizer: True is read by the deepspeed engine only" in message
    assert "model.attn_implementation: 'sdpa' is a Hugging Face attention kernel" in message
    # selective recomputation has no Hugging Face equivalent; full is gradient checkpointing (mapped)
    message = refused(llama3_data, llama3_recipe(llama3_data, "megatron.recompute=selective"))  # on DeepSpeed
    assert "megatron.recompute: 'selective' is read by the megatron engine only" in message
    assert "instead: model.gradient_checkpointing" in message
    full = llama3_recipe(llama3_data, "megatron.recompute=full")
    lines = checks.preflight(full, 2, tokenizer=llama3_data["tokenizer"])
    assert full.model.gradient_checkpointing and full.megatron.recompute is None
    assert any("sets model.gradient_checkpointing: true" in line for line in lines)
    mapped = llama3_recipe(llama3_data, "train.engine=megatron", "model.gradient_checkpointing=true")
    lines = checks.preflight(mapped, 2, tokenizer=llama3_data["tokenizer"])
    assert mapped.megatron.recompute == "full" and not mapped.model.gradient_checkpointing
    assert any("sets megatron.recompute: full" in line for line in lines)
