"""Every file of an export shares one mode: the mode a new file gets under the process's umask (0644
under 022). safetensors (0.7 on) writes through a private temporary file, so before this every weight
file of `final/` was 0600 beside a 0644 config and tokenizer. Both engines' last step before switching an
export in (`recipes.engines.deepspeed.export._finish`, `recipes.engines.megatron.export._assemble`) run on
a staging directory whose shard safetensors itself wrote, under umask 022 and 027 (so the mode follows
the umask, not a constant). The LoRA adapter's files: tests/recipes/models/test_lora.py."""

from __future__ import annotations

import os
import stat

import pytest
import torch


def _modes(directory) -> dict[str, int]:
    return {str(p.relative_to(directory)): stat.S_IMODE(p.stat().st_mode) for p in directory.rglob("*") if p.is_file()}


@pytest.fixture(params=[0o022, 0o027])
def umask(request):
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def _tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))


def test_the_deepspeed_export_writes_every_file_with_one_mode(tmp_path, umask):
    from safetensors.torch import save_file

    from recipes.engines.deepspeed.export import _finish, staging_dir
    from recipes.experiments.tiny import train_tokenizer
    from recipes.training.file_modes import default_file_mode

    tokenizer = train_tokenizer(["0123456789 + ="], tmp_path / "tok", "digits")
    path = tmp_path / "final"
    staging = staging_dir(path)
    staging.mkdir()
    save_file({"w": torch.zeros(2)}, str(staging / "model.safetensors"))
    assert stat.S_IMODE((staging / "model.safetensors").stat().st_mode) == 0o600  # what safetensors does
    _finish([{"file": "model.safetensors", "keys": ["w"], "bytes": 8}], 1, _tiny(), tokenizer, staging, path)
    modes = _modes(path)
    assert "model.safetensors" in modes and "config.json" in modes and "tokenizer.json" in modes, modes
    assert set(modes.values()) == {default_file_mode()} == {0o666 & ~umask}, modes


def test_the_megatron_export_writes_every_file_with_one_mode(tmp_path, umask):
    from safetensors.torch import save_file

    from recipes.engines.megatron.export import _assemble
    from recipes.training.file_modes import default_file_mode

    tmp = tmp_path / ".final.tmp-export"
    tmp.mkdir()
    save_file({"w": torch.zeros(2)}, str(tmp / "stage-0000-00000.safetensors"))
    everyone = [{"stage": 0, "parts": [("stage-0000-00000.safetensors", ["w"], 8)]}]
    _assemble(everyone, tmp, tmp_path / "final", _tiny().config, torch.float32, None)
    modes = _modes(tmp_path / "final")
    assert "model-00001-of-00001.safetensors" in modes and "config.json" in modes, modes
    assert set(modes.values()) == {default_file_mode()} == {0o666 & ~umask}, modes
