"""`MegatronEngine` on gloo/CPU: one recipe, one global batch per step, many layouts.

A tiny tied-embedding Llama (`engine_helpers`) trains 3 steps (CE + SMMD + NTL + NTIL + DIST2, clip and
LR schedule active) at TP 1 (the reference, one process), TP 2, PP 2 (1F1B), DP 2, TP 2 x PP 2 with
sequence parallelism and PP 2 x VP 2 (interleaved) x DP 2, each with another micro-batch x accumulation
split of the same global batch: every layout logs the reference's loss, CE, terms, numeric positions,
grad norm and lr at every step (relative 1e-4, fp32). Checkpoints (`dist_checkpointing`): saved at
step 2 and resumed in a fresh engine at the same layout, step 3 is bit-identical; saved at TP 2 and
resumed at PP 2 (and the reverse), step 3 equals the uninterrupted one within 1e-5. Two examples
packed into one row (segment ids, restarting positions) log what they log as two rows, and the
trained model exports to a directory transformers loads.

Three spawns (1, 2 and 4 processes) run everything once (module fixture); the tests read the results.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.megatron import engine_helpers as H
from tests.megatron.ranks import run_ranks

TWO_RANK_RUNS = ("tp2", "pp2", "dp2")
FOUR_RANK_RUNS = ("tp2_pp2_sp", "pp2_vp2_dp2")


def _engine(rank: int, world: int, assets: dict, **layout):
    from recipes.engines.megatron.engine import MegatronEngine
    from recipes.training.runtime import Runtime

    return MegatronEngine(H.make_recipe(assets, **layout), Runtime(rank, world, 0, torch.device("cpu")))


def _train(rank: int, world: int, assets: dict, out: Path, name: str, save_at: int | None = None,
           export: bool = False, **layout):
    """3 steps at a layout (saving after step `save_at` into out/ckpt_<name>, exporting to
    out/final_<name>); rank 0 writes the rows."""
    engine = _engine(rank, world, assets, **layout)
    rows = H.run_steps(engine, assets, 1, save_at or 3)
    if save_at:
        engine.save_state(out / f"ckpt_{name}", step=save_at)
        rows += H.run_steps(engine, assets, save_at + 1, 3)
    if export:
        engine.export(out / f"final_{name}")
    engine.close()
    if rank == 0:
        H.write(out / f"{name}.json", rows)


def _resume(rank: int, world: int, assets: dict, out: Path, name: str, checkpoint: str, **layout):
    """A fresh engine at a layout loads out/ckpt_<checkpoint> (saved after step 2) and trains step 3."""
    engine = _engine(rank, world, assets, **layout)
    engine.load_state(out / f"ckpt_{checkpoint}")
    rows = H.run_steps(engine, assets, 3, 3)
    engine.close()
    if rank == 0:
        H.write(out / f"{name}.json", rows)


def _packed_step(rank, world, assets, out):
    """Step 1 on two examples packed into one row (segments, restarting positions) and on the same two
    examples as two padded rows, each from fresh weights: rank 0 writes both rows' logged values."""
    rows = {}
    for form, window in H.packed_and_unpacked(assets["tokenizer"]).items():
        engine = _engine(rank, world, assets)
        rows[form] = engine.train_step(window)
        engine.close()
    if rank == 0:
        H.write(out / "packed.json", [rows["packed"], rows["unpacked"]])


def _one_rank(rank, world, assets, out):
    _train(rank, world, assets, Path(out), "reference", export=True, micro=2, accum=4)
    _packed_step(rank, world, assets, Path(out))


def _two_ranks(rank, world, assets, out):
    out = Path(out)
    _train(rank, world, assets, out, "tp2", save_at=2, tp=2, micro=4, accum=2)
    _resume(rank, world, assets, out, "tp2_from_tp2", "tp2", tp=2, micro=4, accum=2)
    _train(rank, world, assets, out, "pp2", save_at=2, pp=2, micro=1, accum=8)
    _resume(rank, world, assets, out, "pp2_from_tp2", "tp2", pp=2, micro=1, accum=8)
    _resume(rank, world, assets, out, "tp2_from_pp2", "pp2", tp=2, micro=2, accum=4)
    _train(rank, world, assets, out, "dp2", micro=2, accum=2)  # DP = world / (TP x PP)


def _four_ranks(rank, world, assets, out):
    out = Path(out)
    _train(rank, world, assets, out, "tp2_pp2_sp", tp=2, pp=2, sp=True, micro=2, accum=4)
    _train(rank, world, assets, out, "pp2_vp2_dp2", pp=2, vpp=2, micro=1, accum=4)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("megatron_engine")
    assets = H.make_assets(root)
    out = root / "out"
    out.mkdir()
    run_ranks(1, _one_rank, assets, str(out), timeout=120)
    run_ranks(2, _two_ranks, assets, str(out), timeout=400)
    run_ranks(4, _four_ranks, assets, str(out), timeout=400)
    return {"dir": str(out), **{p.stem: H.read(p) for p in out.glob("*.json")}}


def _close(got: dict, want: dict, rtol: float, where: str) -> None:
    assert set(got) == set(want), where
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=rtol, abs=1e-12), f"{where} {key}: {got[key]} != {value}"


def test_every_layout_logs_the_reference(results):
    reference = results["reference"]
    assert len(reference) == 3
    assert reference[0]["grad_norm"] > 1.0  # the clip acts
    assert reference[2]["lr"] < reference[0]["lr"]  # the schedule acts
    assert all(reference[0][k] > 1e-3 for k in reference[0] if k.startswith("term/"))
    for name in TWO_RANK_RUNS + FOUR_RANK_RUNS:
        assert len(results[name]) == 3, name
        for step, (got, want) in enumerate(zip(results[name], reference), start=1):
            _close(got, want, 1e-4, f"{name} step {step}")


def test_resume_at_the_same_layout_is_bit_identical(results):
    assert results["tp2_from_tp2"] == results["tp2"][2:]


def test_resume_at_another_layout(results):
    for resumed, uninterrupted in (("pp2_from_tp2", "pp2"), ("tp2_from_pp2", "tp2")):
        _close(results[resumed][0], results[uninterrupted][2], 1e-5, resumed)


def test_packed_rows_train_as_separate_rows(results):
    packed, unpacked = results["packed"]
    _close(packed, unpacked, 1e-5, "packed vs unpacked")


def test_export_loads_in_transformers(results):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = Path(results["dir"]) / "final_reference"
    model = AutoModelForCausalLM.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    ids = tokenizer("the sum of 12 and 30 is 42", return_tensors="pt").input_ids
    assert torch.isfinite(model(ids).logits).all()
