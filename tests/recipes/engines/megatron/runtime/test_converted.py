"""A backbone converted once (`python -m recipes.convert`) and the starts that read no HF weight:

- `python -m recipes.convert` (one process, TP 1 x PP 1) writes a distributed checkpoint with its record;
  into an existing directory it refuses (exit 2) before reading anything;
- on 2 gloo ranks at PP 2 (another layout than the conversion's): the engine started from the converted
  directory (`megatron.load_converted`) holds the parameters of the engine started from the HF checkpoint
  bit for bit, logs the same step-1 values to the bit, and read no HF weight byte (`SafetensorsReader`
  counts every byte any reader of the process returns; the HF start read > 0);
- a resume (a run checkpoint in the run's `CheckpointDirs`) builds the model without reading a byte of the
  HF weights, loads the checkpoint, and its step 2 equals the uninterrupted run's step 2 to the bit;
- `megatron.load_converted` that cannot start (missing, unfinished, another backbone, another dtype) and
  `transformer_impl: transformer_engine` without TE are refused by `recipes.train`'s preflight (exit 2's
  path), every problem named; a run that will resume is not asked for its conversion.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed import run_ranks
from tests.recipes.engines.megatron import engine_helpers as H

REPO = Path(__file__).resolve().parents[5]


class _Position:
    """The data reader's part of a checkpoint (its position), which this test does not move."""

    def state_dict(self) -> dict:
        return {"consumed": 0}

    def load_state_dict(self, state: dict) -> None:
        assert state == {"consumed": 0}


def _engine(recipe, rank: int, world: int, dirs=None):
    from recipes.engines.megatron.runtime.engine import MegatronEngine
    from recipes.training.runtime import Runtime

    return MegatronEngine(recipe, Runtime(rank, world, 0, torch.device("cpu")), dirs)


def _parameters(engine) -> dict[str, torch.Tensor]:
    return {f"{i}.{name}": p.detach().clone() for i, chunk in enumerate(engine.model)
            for name, p in chunk.named_parameters()}


def _bytes_read_everywhere() -> int:
    """Every rank's HF bytes read since the last reset, summed."""
    import torch.distributed as dist

    from recipes.engines.megatron.runtime.convert import SafetensorsReader

    total = torch.tensor([SafetensorsReader.bytes_read_in_process], dtype=torch.float64)
    dist.all_reduce(total)
    return int(total)


def _two_ranks(rank, world, assets, converted, run_dir):
    from recipes.engines.megatron.runtime.convert import SafetensorsReader
    from recipes.reliability.checkpoints import CheckpointDirs
    from recipes.training.runtime import Runtime

    from_hf = H.make_recipe(assets, pp=2, micro=2, accum=4)
    from_converted = dataclasses.replace(from_hf, megatron=dataclasses.replace(from_hf.megatron,
                                                                                load_converted=str(converted)))
    SafetensorsReader.bytes_read_in_process = 0
    engine = _engine(from_hf, rank, world)
    assert engine.weights_from.startswith("HF") and _bytes_read_everywhere() > 0
    want, want_row = _parameters(engine), H.run_steps(engine, assets, 1, 1)
    engine.close()

    SafetensorsReader.bytes_read_in_process = 0
    engine = _engine(from_converted, rank, world)
    assert engine.weights_from == f"converted {converted}" and _bytes_read_everywhere() == 0
    got = _parameters(engine)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), f"rank {rank}: {name}"
    assert H.run_steps(engine, assets, 1, 1) == want_row
    engine.close()

    # a run from HF saves after step 1 and trains step 2; the same run restarted resumes from its checkpoint
    runtime = Runtime(rank, world, 0, torch.device("cpu"))
    dirs = CheckpointDirs(run_dir, keep_last=2, runtime=runtime)
    engine = _engine(from_hf, rank, world, dirs)
    assert engine.weights_from.startswith("HF")
    H.run_steps(engine, assets, 1, 1)
    dirs.save(1, _Position(), lambda directory: engine.save_state(directory, 1), engine.layout)
    uninterrupted = H.run_steps(engine, assets, 2, 2)
    engine.close()

    SafetensorsReader.bytes_read_in_process = 0
    dirs = CheckpointDirs(run_dir, keep_last=2, runtime=runtime)
    engine = _engine(from_hf, rank, world, dirs)
    assert engine.weights_from == "the run's checkpoint" and _bytes_read_everywhere() == 0
    assert dirs.load(_Position(), engine.load_state) == 1
    assert H.run_steps(engine, assets, 2, 2) == uninterrupted
    engine.close()


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict:
    """The tiny backbone converted by the command line, one process."""
    from recipes.config import dump_recipe

    root = tmp_path_factory.mktemp("converted")
    assets = H.make_assets(root)
    recipe_file = root / "recipe.yaml"
    dump_recipe(H.make_recipe(assets), recipe_file)
    out = root / "converted"
    done = subprocess.run([sys.executable, "-m", "recipes.convert", str(recipe_file), "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=REPO, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return {"root": root, "assets": assets, "recipe_file": recipe_file, "out": out, "done": done}


def test_the_command_converts_once(converted):
    out = converted["out"]
    summary = json.loads(converted["done"].stdout.strip().splitlines()[-1])
    record = json.loads((out / "numloss_converted.json").read_text())
    assert summary["out"] == str(out) and summary["hf_bytes_read"] > 0 and summary["layer_spec"] == "local"
    assert record["layout"] == {"tp": 1, "pp": 1, "vp": None} and record["dtype"] == "float32"
    assert record["hf_config"]["num_hidden_layers"] == 4 and (out / "metadata.json").is_file()
    assert not (out.parent / f"{out.name}.partial").exists()
    again = subprocess.run([sys.executable, "-m", "recipes.convert", str(converted["recipe_file"]), "--out", str(out),
                            "--tp", "2"], capture_output=True, text=True, timeout=300, cwd=REPO, check=False)
    assert again.returncode == 2
    assert f"--out {out} exists" in again.stderr and "--tp 2 x --pp 1 must equal the world size 1" in again.stderr


def test_a_converted_start_and_a_resume_read_no_hf_weights(converted):
    run_ranks(2, _two_ranks, converted["assets"], converted["out"], converted["root"] / "run", timeout=400)


def test_what_cannot_start_is_refused_before_the_engine(converted, tmp_path):
    from recipes.checks.preflight import RecipeCheckError, preflight

    recipe = H.make_recipe(converted["assets"])
    recipe.data.train = str(tmp_path / "no-data")

    def problems(**megatron) -> str:
        changed = dataclasses.replace(recipe, megatron=dataclasses.replace(recipe.megatron, **megatron))
        with pytest.raises(RecipeCheckError) as refused:
            preflight(changed, world_size=1)
        return str(refused.value)

    assert "megatron.load_converted: " + str(tmp_path / "none") + " does not exist" in problems(
        load_converted=str(tmp_path / "none"))
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    assert "is not a finished conversion (no numloss_converted.json)" in problems(load_converted=str(unfinished))
    other = tmp_path / "other"
    other.mkdir()
    record = json.loads((converted["out"] / "numloss_converted.json").read_text())
    record["hf_config"]["num_hidden_layers"], record["dtype"] = 8, "bfloat16"
    (other / "numloss_converted.json").write_text(json.dumps(record))
    text = problems(load_converted=str(other))
    assert "holds a backbone with num_hidden_layers 8, the recipe's model has 4" in text
    assert "was converted in bfloat16, the recipe trains in float32" in text
    assert "transformer_engine needs CUDA and Transformer Engine" in problems(transformer_impl="transformer_engine")
    # recipes.validate reports the conversion too (and leaves TE to the machine the job runs on)
    from recipes.config import dump_recipe
    from recipes.validation.validate import validate_recipe

    dump_recipe(dataclasses.replace(recipe, megatron=dataclasses.replace(
        recipe.megatron, load_converted=str(unfinished), transformer_impl="transformer_engine")), tmp_path / "r.yaml")
    errors = validate_recipe(tmp_path / "r.yaml", size=False, recommend=False).errors
    assert any("is not a finished conversion" in e for e in errors)
    assert not any("transformer_engine" in e for e in errors), errors
    # a run that will resume reads its own checkpoint: the conversion it started from may be gone
    recipe.train.out_dir = str(tmp_path / "run")
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step_00000001")
    assert "load_converted" not in problems(load_converted=str(tmp_path / "none"))
