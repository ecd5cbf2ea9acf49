"""recipes.checks.run_dir_checks: the checkpoint a run would resume from (its `layout.json`) against the
recipe, before the base model loads: LoRA resuming onto another data-parallel size (the same size
resumes), a full fine-tune onto a LoRA checkpoint, and a checkpoint the other engine saved are refused,
naming the checkpoint. (`train.out_dir` naming a file: test_preflight.py, through `python -m recipes.train`.)
"""

from __future__ import annotations

import json
from pathlib import Path

from recipes.checks import preflight as checks
from tests.recipes.checks.helpers import llama3_recipe, refused


def _checkpoint(out_dir: Path, layout: dict) -> None:
    """A run directory whose latest checkpoint recorded `layout` (as recipes.reliability.checkpoints writes it)."""
    step = out_dir / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    (step / "layout.json").write_text(json.dumps(layout))
    (out_dir / "checkpoints" / "latest").write_text("step_00000002")


def test_lora_resume_onto_another_data_parallel_size_is_refused_before_the_base_loads(llama3_data, tmp_path):
    _checkpoint(tmp_path / "run", {"data_parallel": 2, "tensor_parallel": 1, "zero_stage": 3, "lora": True})
    lora = llama3_recipe(llama3_data, f"train.out_dir={tmp_path / 'run'}", "model.lora={r: 4}")
    message = refused(llama3_data, lora, world_size=4)
    assert f"model.lora: {tmp_path / 'run/checkpoints/step_00000002'} was saved on 2 data-parallel ranks" in message
    assert "(this run has 4)" in message
    checks.preflight(lora, 2, tokenizer=llama3_data["tokenizer"])  # the same size resumes
    full = llama3_recipe(llama3_data, f"train.out_dir={tmp_path / 'run'}")  # a full fine-tune onto a LoRA checkpoint
    message = refused(llama3_data, full, world_size=2)
    assert "model.lora: " in message and "lora=True; this run has None" in message
    megatron = llama3_recipe(llama3_data, f"train.out_dir={tmp_path / 'run'}", "train.engine=megatron")
    assert "was saved by the deepspeed engine" in refused(llama3_data, megatron, world_size=2)
