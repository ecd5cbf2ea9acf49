"""recipes.evaluation.placement: how many GPUs an export gets, from its size, its heads and the node."""

import json
import os
from pathlib import Path

import pytest

from recipes.evaluation.placement import WEIGHT_SHARE, Placement, attention_heads, export_weight_bytes, plan_placement

GIB = 2**30
LLAMA_70B_BF16 = 70_553_706_496 * 2  # parameters x 2 bytes: 141 GB, 131.4 GiB


@pytest.mark.parametrize("size, heads, gpus, gpu_gib, expected", [
    (LLAMA_70B_BF16, 64, 8, 80, 4),    # 32.9 GiB a GPU <= 56 GiB; 2 GPUs would be 65.7
    (LLAMA_70B_BF16, 64, 8, 141, 2),   # H200: 65.7 GiB <= 98.7
    (16 * 10**9, 32, 8, 80, 1),        # an 8B export fits one GPU
    (LLAMA_70B_BF16, 64, 0, None, 0),  # no GPU: the CPU
    (LLAMA_70B_BF16, 6, 6, 80, 6),     # 4 does not divide 6 heads: the node's 6
])
def test_gpu_count_from_the_export_size(size, heads, gpus, gpu_gib, expected, tmp_path):
    p = plan_placement(tmp_path, gpus, gpu_gib and gpu_gib * GIB, weight_bytes=size, heads=heads)
    assert p == Placement(expected, max(expected, 1), "auto" if expected > 1 else None, size)
    if expected:  # independent check: the share fits, and no smaller power of two fits and divides the heads
        assert size / expected <= WEIGHT_SHARE * gpu_gib * GIB
        for n in (1, 2, 4):
            if n < expected:
                assert size / n > WEIGHT_SHARE * gpu_gib * GIB or heads % n


def test_an_export_that_fits_no_gpu_count_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"131\.4 GiB of weights do not fit on 1 GPU\(s\) of 80 GiB"):
        plan_placement(tmp_path, 1, 80 * GIB, weight_bytes=LLAMA_70B_BF16, heads=64)
    with pytest.raises(ValueError, match="attention heads: 6"):
        plan_placement(tmp_path, 4, 80 * GIB, weight_bytes=LLAMA_70B_BF16, heads=6)
    with pytest.raises(ValueError, match="memory of the node's GPUs is unknown"):
        plan_placement(tmp_path, 4, None, weight_bytes=LLAMA_70B_BF16, heads=64)


def test_size_and_heads_are_read_from_the_export(rec_model_dir, tmp_path):
    weights = [f for f in os.listdir(rec_model_dir) if f.endswith(".safetensors")]
    assert weights and export_weight_bytes(rec_model_dir) == sum(os.path.getsize(Path(rec_model_dir) / f)
                                                                  for f in weights)
    assert attention_heads(rec_model_dir) == json.loads((Path(rec_model_dir) / "config.json").read_text())[
        "num_attention_heads"] == 4
    with pytest.raises(FileNotFoundError, match="no weight files"):
        export_weight_bytes(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"num_attention_heads": 28}}))
    assert attention_heads(tmp_path) == 28  # a vision-language export: its text model's heads


def test_a_hub_name_has_no_size_here(monkeypatch):
    import recipes.evaluation.placement as P

    monkeypatch.setattr(P, "local_gpus", lambda: (4, 80 * GIB))
    assert P.place_here("Qwen/Qwen2.5-1.5B") == Placement(1, 1, "auto", None)
    monkeypatch.setattr(P, "local_gpus", lambda: (0, None))
    assert P.place_here("Qwen/Qwen2.5-1.5B") == Placement(0, 1, None, None)
