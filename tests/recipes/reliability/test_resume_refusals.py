"""What needs only the recipe, the checkpoint's records and the data's manifest is refused before any model
is built, and before anything in the run directory is rewritten (recipe.yaml, recipe_history.jsonl):
recipes/reliability/resume_policy.py (global batch, the ZeRO stage; a stage `deepspeed.overrides` sets against
`deepspeed.zero_stage` is refused when the recipe loads: recipes/engines/deepspeed/config.py) and
recipes/checks/preflight.py (every shard's size, or sha256 with `data.verify: full`).

Before: a global batch changed on resume was accepted, the engine built, then the reader raised a plain
ValueError (exit 1); a ZeRO stage changed through `deepspeed.overrides` ended in DeepSpeed's AssertionError
with a hint to fall back to an older checkpoint; a truncated shard was named only after the model was
loaded; a same-size change (`data.verify: full`) only after recipe.yaml and the history were rewritten.
One real run (DeepSpeed ZeRO-3, one process, 2 steps), then each start on it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from tests.recipes.torchrun_helpers import REPO, tiny_workspace  # noqa: E402

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("refusals")
    recipe = tiny_workspace(root, problems=32, max_digits=2, hidden=32,
                            train={"steps": 2, "micro_batch_size": 2, "save_every": 2, "tensorboard": False,
                                   "export": False})
    out = root / "run"
    done = _start(recipe, out)
    assert done.returncode == 0, done.stderr[-3000:]
    return root, recipe, out


def _start(recipe: Path, out: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "recipes.train", str(recipe), f"train.out_dir={out}", *overrides],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def _written(out: Path) -> dict[str, str]:
    return {name: hashlib.sha256((out / name).read_bytes()).hexdigest()
            for name in ("recipe.yaml", "recipe_history.jsonl", "metrics.jsonl")}


def _refused_before_the_engine(result: subprocess.CompletedProcess, out: Path, before: dict) -> str:
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert "engine deepspeed" not in result.stdout and "resumed" not in result.stdout
    assert _written(out) == before
    return result.stderr


def test_a_global_batch_and_a_zero_stage_the_checkpoint_cannot_take_are_refused_first(run):
    root, recipe, out = run
    before = _written(out)
    more = "train.steps=4"  # a start that would train
    err = _refused_before_the_engine(_start(recipe, out, more, "train.micro_batch_size=4"), out, before)
    assert ("its global batch is train.micro_batch_size 4 x train.grad_accum 1 x 1 data-parallel ranks = 4 rows, "
            "the checkpoint trained with 2 x 1 x 1 = 2") in err, err[-3000:]
    assert "e.g. train.micro_batch_size=2 train.grad_accum=1" in err

    # a stage the overrides set against deepspeed.zero_stage is refused when the recipe loads (the engine
    # decides by the key); a stage changed in the key (and the overrides), by the checkpoint's layout
    err = _refused_before_the_engine(_start(recipe, out, more, "deepspeed.overrides={zero_optimization: {stage: 2}}"),
                                     out, before)
    assert "deepspeed.overrides.zero_optimization.stage: 2 contradicts deepspeed.zero_stage: 3" in err, err[-3000:]
    err = _refused_before_the_engine(_start(recipe, out, more, "deepspeed.zero_stage=2",
                                            "deepspeed.overrides={zero_optimization: {stage: 2}}"), out, before)
    assert "deepspeed.zero_stage: " in err and "was saved with zero_stage=3; this run has 2" in err, err[-3000:]

    # the same global batch split otherwise, and the same stage written in the overrides: accepted (the run
    # is finished: nothing to do)
    same = _start(recipe, out, "train.micro_batch_size=1", "train.grad_accum=2",
                  "deepspeed.overrides={zero_optimization: {stage: 3}}")
    assert same.returncode == 0 and "already finished" in same.stdout, same.stdout[-2000:] + same.stderr[-3000:]


def test_a_damaged_shard_is_named_before_the_engine_and_before_anything_is_rewritten(run):
    root, recipe, out = run
    before = _written(out)
    shard = sorted((root / "data").glob("shard-*.parquet"))[0]
    original = shard.read_bytes()
    try:
        shard.write_bytes(original[:-10])  # truncated
        err = _refused_before_the_engine(_start(recipe, out, "train.steps=4"), out, before)
        assert f"data.train: {shard}: {len(original) - 10} bytes, the manifest records {len(original)}" in err, err[-3000:]

        damaged = bytearray(original)
        damaged[len(damaged) // 2] ^= 0xFF  # the same size: only the sha256 tells
        shard.write_bytes(bytes(damaged))
        err = _refused_before_the_engine(_start(recipe, out, "train.steps=4", "data.verify=full"), out, before)
        assert f"data.train: {shard}: its sha256 differs from the manifest's" in err, err[-3000:]
    finally:
        shard.write_bytes(original)


def test_the_stage_deepspeed_runs_is_what_a_resume_compares():
    from recipes.reliability.resume_policy import _engine_views, recipe_changes

    saved = {"deepspeed": {"zero_stage": 3, "overrides": {}}}
    by_override = {"deepspeed": {"zero_stage": 3, "overrides": {"zero_optimization": {"stage": 2, "overlap_comm": False}}}}
    changes = recipe_changes(_engine_views(saved), _engine_views(by_override))
    assert [(c.key, c.old, c.new, c.kind) for c in changes] == [
        ("deepspeed.overrides.zero_optimization", "(absent)", {"overlap_comm": False}, "run"),
        ("deepspeed.zero_stage", 3, 2, "refused")]
    moved = {"deepspeed": {"zero_stage": 2, "overrides": {}}}  # the same stage 2, written in the section
    assert recipe_changes(_engine_views({"deepspeed": {"zero_stage": 3, "overrides": {
        "zero_optimization": {"stage": 2}}}}), _engine_views(moved)) == []


def test_the_global_batch_is_compared_across_layouts_and_splits():
    from types import SimpleNamespace

    from recipes.reliability.resume_policy import global_batch_problem

    saved = {"train": {"micro_batch_size": 2, "grad_accum": 2}}  # on 2 data-parallel ranks: 8 rows

    def recipe(micro, accum):
        return SimpleNamespace(train=SimpleNamespace(micro_batch_size=micro, grad_accum=accum))

    assert global_batch_problem(recipe(1, 4), saved, 2, 2, "ckpt") is None  # another split of the same 8
    assert global_batch_problem(recipe(2, 1), saved, 2, 4, "ckpt") is None  # 4 ranks x 2: the same 8
    assert global_batch_problem(recipe(2, 2), saved, None, 4, "ckpt") is None  # the layout not recorded
    problem = global_batch_problem(recipe(2, 2), saved, 2, 4, "ckpt")  # 16 rows
    assert "= 16 rows, the checkpoint trained with 2 x 2 x 2 = 8" in problem
    assert "e.g. train.micro_batch_size=2 train.grad_accum=1 on these 4 data-parallel ranks" in problem
    assert "no split reaches 8 rows on 3 data-parallel ranks: resume on 2" in global_batch_problem(
        recipe(1, 1), saved, 2, 3, "ckpt")
