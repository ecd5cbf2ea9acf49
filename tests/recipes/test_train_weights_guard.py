"""Weights that go non-finite while the loss stays finite are never saved or exported, on both engines
(docs/reliability.md, "Non-finite training stops"): `recipes.train` on 2 real ranks (fork-server ranks
holding a gloo group, `tests.distributed.train_in_ranks`), DeepSpeed ZeRO-3 (each rank holds a partition)
and Megatron TP 2 (each rank holds a shard).

An update that makes the weights infinite after its step's loss was computed is what the guard is for
(`optim.lr: 1e39`); here the run's own hooks stand in for that update, on the real engine's own tensors:
rank 1 sets one entry of its share to inf after a step's row is logged (the loss of that step finite),
- before the checkpoint due at that step (`on_log` of step 2, save every step): the save is refused on
  both ranks, `latest` stays step 1, no export;
- after the last checkpoint (`on_checkpoint` of the final save): the export is refused, `final/` never
  appears, and the checkpoint (saved before the weights went bad) is `latest`.
Each hook also calls the engine's own `weights_finite()` before and after: True on both ranks, then
False on rank 1 only (its own share), so the refusal on rank 0 is the ranks' agreement.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("megatron.core")

from tests.distributed import train_in_ranks  # noqa: E402
from tests.recipes.torchrun_helpers import tiny_workspace  # noqa: E402

pytestmark = pytest.mark.timeout(600)

ENGINES = {"deepspeed": ["deepspeed.zero_stage=3"], "megatron": ["train.engine=megatron", "megatron.tp_size=2"]}


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights_guard")
    return tiny_workspace(root, problems=32, max_digits=2, hidden=32,
                          train={"micro_batch_size": 4, "grad_accum": 1, "keep_last": 3, "tensorboard": False})


def _own_share(engine):
    """The tensors this rank holds of the model's weights: DeepSpeed ZeRO-3's partitions, Megatron's shards."""
    if hasattr(engine, "engine"):
        return [getattr(p, "ds_tensor", p.data) for p in engine.engine.module.parameters()]
    return [p.data for chunk in engine.model for p in chunk.parameters()]


def _poisoning_hooks(rank: int, when: str):
    """Hooks that make rank 1's share non-finite at step 2 (`when`: "on_log" or "on_checkpoint"), recording
    each rank's `engine.weights_finite()` before and after into the run's folder."""
    import torch

    import recipes.train as T

    built = {}
    real_build = T.build_engine

    def build_and_keep(recipe, *args, **kwargs):
        built["engine"], built["out"] = real_build(recipe, *args, **kwargs), Path(recipe.train.out_dir)
        return built["engine"]

    T.build_engine = build_and_keep  # this rank's process only: it ends with the run

    def poison(step: int) -> None:
        if step != 2:
            return
        engine, out = built["engine"], built["out"]
        before = engine.weights_finite()
        if rank == 1:
            share = next(t for t in _own_share(engine) if t.numel())
            with torch.no_grad():
                share.view(-1)[0] = math.inf
        (out / f"weights_finite.{rank}.json").write_text(json.dumps([before, engine.weights_finite()]))

    if when == "on_log":
        return T.Hooks(on_log=lambda row: poison(row["step"]))
    return T.Hooks(on_checkpoint=lambda step, path: poison(step))


def poison_before_the_save(rank: int):
    return _poisoning_hooks(rank, "on_log")


def poison_after_the_last_save(rank: int):
    return _poisoning_hooks(rank, "on_checkpoint")


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _assert_refused_on_both_ranks(outcomes, latest: str) -> None:
    for outcome in outcomes:
        assert outcome["error"] == "NonFiniteTraining", outcomes
        assert outcome["message"].startswith("step 2: the weights after the update not finite; "
                                             "stopped without saving or exporting"), outcomes
        assert f"the last checkpoint is {latest} (finite)" in outcome["message"], outcomes


@pytest.mark.parametrize("engine", ENGINES)
def test_weights_gone_non_finite_before_a_save_are_not_saved(recipe, tmp_path, engine):
    out = tmp_path / "run"
    outcomes = train_in_ranks(2, [str(recipe), f"train.out_dir={out}", "train.steps=3", "train.save_every=1",
                                  *ENGINES[engine]], hooks=f"{__name__}:poison_before_the_save")
    assert [json.loads((out / f"weights_finite.{r}.json").read_text()) for r in (0, 1)] == [[True, True], [True, False]]
    _assert_refused_on_both_ranks(outcomes, "step_00000001")
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2]  # step 2 logged (its values finite), step 3 never ran
    assert all(math.isfinite(r["loss"]) and "nonfinite" not in r for r in rows)
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_00000001"]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000001"
    assert not (out / "final").exists()


@pytest.mark.parametrize("engine", ENGINES)
def test_weights_gone_non_finite_after_the_last_save_are_not_exported(recipe, tmp_path, engine):
    out = tmp_path / "run"
    outcomes = train_in_ranks(2, [str(recipe), f"train.out_dir={out}", "train.steps=2", "train.save_every=0",
                                  "train.export=true", *ENGINES[engine]], hooks=f"{__name__}:poison_after_the_last_save")
    assert [json.loads((out / f"weights_finite.{r}.json").read_text()) for r in (0, 1)] == [[True, True], [True, False]]
    _assert_refused_on_both_ranks(outcomes, "step_00000002")
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000002"  # saved while finite
    assert not (out / "final").exists() and not list(out.glob(".final*"))
