"""`MegatronEngine` on gloo/CPU: one recipe, one global batch per step, many layouts.

A tiny tied-embedding Llama (`engine_helpers`) trains 3 steps (CE + SMMD + NTL + NTIL + DIST2, clip and
LR schedule active) at TP 1 (the reference, one process), TP 2, PP 2 (1F1B), DP 2, TP 2 x PP 2 with
sequence parallelism and PP 2 x VP 2 (interleaved) x DP 2, each with another micro-batch x accumulation
split of the same global batch: every layout logs the reference's loss, CE, terms, numeric positions,
grad norm, lr and per-term gradient diagnostics (`grad/<part>/norm`, `share`, `cos_ce` and `clipped`,
finished from the step's gradient sums as the loop does) at every step (relative 1e-4, fp32; the
diagnostics within 1e-6 absolute too: a cosine near 0 has no relative precision). Each micro-batch runs
at its own length: at PP 2 with one row per micro-batch the lengths differ within a step (13 to 16
tokens: the p2p shapes are exchanged) and step 1 equals the reference within 1e-5; every layout reports
the positions it ran (`tokens_run`), counted here from the rows. The THD path of the Transformer Engine
spec runs with megatron's own attention per sequence in place of TE's kernel (`thd_attention.py`) at TP
2 + SP and PP 2 and logs the reference too. Checkpoints (`dist_checkpointing`): saved at step 2 and
resumed in a fresh engine at the same layout, step 3 is bit-identical; saved at TP 2 and resumed at PP 2
(and the reverse), step 3 equals the uninterrupted one within 1e-5. Two examples packed into one row
(segment ids, restarting positions) log what they log as two rows (1e-5), with the block mask at TP 1,
TP 2 + SP and PP 2 and as THD sequences at TP 1 and PP 2, and the trained model exports to a directory
transformers loads.

Three spawns (1, 2 and 4 processes) run everything once (module fixture); the tests read the results.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.recipes.engines.megatron import engine_helpers as H
from tests.distributed import run_ranks

TWO_RANK_RUNS = ("tp2", "pp2", "dp2", "tp2_sp_thd", "pp2_thd")
PACKED_RUNS = ("packed", "packed_thd", "packed_tp2_sp", "packed_pp2", "packed_pp2_thd")
FOUR_RANK_RUNS = ("tp2_pp2_sp", "pp2_vp2_dp2")


def _engine(rank: int, world: int, assets: dict, thd: bool = False, **layout):
    return _engine_for(H.make_recipe(assets, **layout), rank, world, thd)


def _train(rank: int, world: int, assets: dict, out: Path, name: str, save_at: int | None = None,
           export: bool = False, thd: bool = False, **layout):
    """3 steps at a layout (saving after step `save_at` into out/ckpt_<name>, exporting to
    out/final_<name>; `thd`: packed as THD sequences); rank 0 writes the rows."""
    engine = _engine(rank, world, assets, thd, **layout)
    rows = H.run_steps(engine, assets, 1, save_at or 3, diagnostics=True)
    if save_at:
        engine.save_state(out / f"ckpt_{name}", step=save_at)
        rows += H.run_steps(engine, assets, save_at + 1, 3, diagnostics=True)
    if export:
        engine.export(out / f"final_{name}")
    engine.close()
    if rank == 0:
        H.write(out / f"{name}.json", rows)


def _resume(rank: int, world: int, assets: dict, out: Path, name: str, checkpoint: str, first: int = 3, **layout):
    """A fresh engine at a layout loads out/ckpt_<checkpoint> (saved after step `first` - 1) and trains
    steps `first`..3."""
    engine = _engine(rank, world, assets, **layout)
    engine.load_state(out / f"ckpt_{checkpoint}")
    rows = H.run_steps(engine, assets, first, 3, diagnostics=True)
    engine.close()
    if rank == 0:
        H.write(out / f"{name}.json", rows)


def _packed_step(rank, world, assets, out, name: str = "packed", thd: bool = False, **layout):
    """Step 1 on two examples packed into one row (segments, restarting positions; as THD sequences with
    `thd`) and on the same two examples as two padded rows under the block mask, each from fresh
    weights: rank 0 writes both rows' logged values into out/<name>.json."""
    rows = {}
    for form, window in H.packed_and_unpacked(assets["tokenizer"]).items():
        engine = _engine(rank, world, assets, thd and form == "packed", **layout)
        rows[form] = engine.train_step(window)
        engine.close()
    if rank == 0:
        H.write(Path(out) / f"{name}.json", [rows["packed"], rows["unpacked"]])


def _bf16_optimizer(rank, world, assets, out):
    """The CPU optimizer on a bf16 model, driven directly: 4 steps on set gradients (the same each step,
    clipped: the norm of N(0, 1) over every weight is far above 1) at lr 1e-3, and torch's AdamW on
    fp32 copies of the starting weights with the same gradients, clip and schedule. Rank 0 saves the
    main parameters, the model's, the reference after each step and the norms."""
    from recipes.training.schedule import lr_lambda

    engine = _engine_for(H.make_recipe(assets, dtype="bfloat16", lr=1e-3, steps=4), rank, world)
    opt = engine.optimizer
    o = engine.recipe.optim
    reference = [p.detach().float().clone() for p in opt.params]
    ref_opt = torch.optim.AdamW(reference, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    ref_schedule = torch.optim.lr_scheduler.LambdaLR(ref_opt, lr_lambda(engine.recipe))
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=g) for p in opt.params]
    snapshots, norms = [[r.clone() for r in reference]], []
    for _ in range(4):
        opt.zero_grad()
        for p, grad in zip(opt.params, grads):
            p.main_grad.copy_(grad)
        norms.append((opt.step(), float(torch.stack([grad.double().square().sum() for grad in grads]).sum().sqrt())))
        for r, grad in zip(reference, grads):
            r.grad = grad.clone().mul_(o.grad_clip / (norms[-1][0] + 1e-6))
        ref_opt.step()
        ref_schedule.step()
        snapshots.append([r.clone() for r in reference])
    if rank == 0:
        torch.save({"main": [m.clone() for m in opt.main_params], "model": [p.detach().clone() for p in opt.params],
                    "snapshots": snapshots, "norms": norms}, Path(out) / "bf16_optimizer.pt")
    engine.close()


def _engine_for(recipe, rank: int, world: int, thd: bool = False):
    """The engine for `recipe`; `thd`: the Transformer Engine spec's packing (THD sequences), with
    megatron's attention run per sequence in place of TE's kernel (`thd_attention.py`)."""
    from recipes.engines.megatron.runtime.engine import MegatronEngine
    from recipes.engines.megatron.pure.kernels import plan_kernels
    from recipes.training.runtime import Runtime
    from tests.recipes.engines.megatron.thd_attention import PerSequenceAttention

    kernels = None
    if thd:
        kernels = dataclasses.replace(plan_kernels(recipe.megatron, cuda=False), packing="thd", core_attention=PerSequenceAttention)
    return MegatronEngine(recipe, Runtime(rank, world, 0, torch.device("cpu")), kernels=kernels)


def _one_rank(rank, world, assets, out):
    _train(rank, world, assets, Path(out), "reference", export=True, micro=2, accum=4)
    _packed_step(rank, world, assets, Path(out))
    _packed_step(rank, world, assets, Path(out), "packed_thd", thd=True)
    _bf16_optimizer(rank, world, assets, out)


def _two_ranks(rank, world, assets, out):
    out = Path(out)
    _train(rank, world, assets, out, "tp2", save_at=2, tp=2, micro=4, accum=2)
    _resume(rank, world, assets, out, "tp2_from_tp2", "tp2", tp=2, micro=4, accum=2)
    _train(rank, world, assets, out, "pp2", save_at=2, pp=2, micro=1, accum=8)
    _resume(rank, world, assets, out, "pp2_from_tp2", "tp2", pp=2, micro=1, accum=8)
    _resume(rank, world, assets, out, "tp2_from_pp2", "pp2", tp=2, micro=2, accum=4)
    _train(rank, world, assets, out, "dp2", micro=2, accum=2, pad=8)  # DP = world / (TP x PP); 8: rounded up
    # saved after step 1: step 3's loss is the first to read an update made after the resume
    _train(rank, world, assets, out, "tp2_bf16", save_at=1, tp=2, micro=4, accum=2, dtype="bfloat16")
    _resume(rank, world, assets, out, "tp2_bf16_from_tp2_bf16", "tp2_bf16", first=2, tp=2, micro=4, accum=2,
            dtype="bfloat16")
    _train(rank, world, assets, out, "tp2_sp_thd", tp=2, sp=True, micro=4, accum=2, thd=True)
    _train(rank, world, assets, out, "pp2_thd", pp=2, micro=2, accum=4, thd=True)
    _packed_step(rank, world, assets, out, "packed_tp2_sp", tp=2, sp=True)
    _packed_step(rank, world, assets, out, "packed_pp2", pp=2)
    _packed_step(rank, world, assets, out, "packed_pp2_thd", thd=True, pp=2)


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
    run_ranks(1, _one_rank, assets, str(out), timeout=240)
    run_ranks(2, _two_ranks, assets, str(out), timeout=400)
    run_ranks(4, _four_ranks, assets, str(out), timeout=400)
    return {"dir": str(out), **{p.stem: H.read(p) for p in out.glob("*.json")}}


def _close(got: dict, want: dict, rtol: float, where: str) -> None:
    """Every logged value equal within `rtol` (the gradient diagnostics also within 1e-6 absolute); the
    positions run (`tokens_run`) depend on the layout's micro-batch split and padding and are checked on
    their own."""
    assert set(got) == set(want), where
    for key, value in want.items():
        if key == "tokens_run":
            continue
        tolerance = 1e-6 if key.startswith("grad/") else 1e-12
        assert got[key] == pytest.approx(value, rel=rtol, abs=tolerance), f"{where} {key}: {got[key]} != {value}"


def test_every_layout_logs_the_reference(results):
    reference = results["reference"]
    assert len(reference) == 3
    assert reference[0]["grad_norm"] > 1.0  # the clip acts
    assert reference[2]["lr"] < reference[0]["lr"]  # the schedule acts
    assert all(reference[0][k] > 1e-3 for k in reference[0] if k.startswith("term/"))
    assert all(0 < row["grad/smmd/share"] < 1 and row["grad/ntil/norm"] > 0 for row in reference)  # diagnosed
    for name in TWO_RANK_RUNS + FOUR_RANK_RUNS:
        assert len(results[name]) == 3, name
        for step, (got, want) in enumerate(zip(results[name], reference), start=1):
            _close(got, want, 1e-4, f"{name} step {step}")


def _tokens_run(step: int, assets_dir: Path, micro: int, multiple: int = 1, thd: bool = False) -> int:
    """The positions a layout runs in a step, counted from the rows: each micro-batch's rows padded to its
    longest row rounded up to `multiple` (mask), or its real tokens rounded up to `multiple` (THD)."""
    rows = H.global_batch(step, str(assets_dir / "tokenizer"))
    real = [int(row["attention_mask"].sum()) for row in rows]
    groups = [real[i:i + micro] for i in range(0, len(real), micro)]

    def up(n: int) -> int:
        return -(-n // multiple) * multiple

    return sum(up(sum(g)) if thd else len(g) * up(max(g)) for g in groups)


def test_each_micro_batch_runs_at_its_own_length(results):
    """At PP 2 with one row per micro-batch the step's micro-batches have different lengths (the shapes
    exchanged between stages), and step 1 equals the reference within 1e-5; every layout reports the
    positions it ran."""
    assets = Path(results["dir"]).parent
    pp2 = results["pp2"]
    assert len({int(row["attention_mask"].sum()) for row in H.global_batch(1, str(assets / "tokenizer"))}) > 1
    _close(pp2[0], results["reference"][0], 1e-5, "pp2 step 1")
    for step in (1, 2, 3):
        assert pp2[step - 1]["tokens_run"] == _tokens_run(step, assets, micro=1) < H.ROWS * H.SEQ
        assert results["reference"][step - 1]["tokens_run"] == _tokens_run(step, assets, micro=2)
        assert results["tp2_sp_thd"][step - 1]["tokens_run"] == _tokens_run(step, assets, micro=4,
                                                                            multiple=2, thd=True)
        assert results["pp2_thd"][step - 1]["tokens_run"] == _tokens_run(step, assets, micro=2, thd=True)
        assert results["dp2"][step - 1]["tokens_run"] == _tokens_run(step, assets, micro=2, multiple=8)  # pad 8


def test_resume_at_the_same_layout_is_bit_identical(results):
    assert results["tp2_from_tp2"] == results["tp2"][2:]


def test_bf16_trains_through_fp32_main_parameters(results):
    """A bf16 model on the CPU path keeps fp32 main parameters (as megatron-core's optimizer on the GPU):
    they follow torch's fp32 AdamW to float rounding, the model holds their bf16 rounding, and weights
    move that no single step could move in bf16 (each update below half a bf16 step of the weight,
    4 steps above it: in pure bf16 they stay where they started)."""
    saved = torch.load(Path(results["dir"]) / "bf16_optimizer.pt")
    main, model, snapshots = saved["main"], saved["model"], saved["snapshots"]
    for norm, independent in saved["norms"]:
        assert norm == pytest.approx(independent, rel=1e-9) and norm > 1.0  # the clip acts
    assert all(m.dtype == torch.float32 for m in main) and all(p.dtype == torch.bfloat16 for p in model)
    for m, p, r in zip(main, model, snapshots[-1]):
        torch.testing.assert_close(m, r, rtol=1e-6, atol=1e-7)
        assert torch.equal(p, m.to(torch.bfloat16))
    start = torch.cat([s.flatten() for s in snapshots[0]])
    steps = [torch.cat([s.flatten() for s in snap]) for snap in snapshots]
    # half the smaller of a weight's two bf16 neighbours' distances: bf16 keeps 8 significant bits, so for
    # x = m * 2**e (0.5 <= m < 1) the step above is 2**(e - 8), the one below as small as 2**(e - 9)
    half_ulp = torch.ldexp(torch.ones_like(start), torch.frexp(start).exponent - 10)
    largest_update = torch.stack([(b - a).abs() for a, b in zip(steps, steps[1:])]).amax(0)
    model_moved = torch.cat([p.flatten() for p in model]).float() != start.bfloat16().float()
    only_accumulated = (largest_update < half_ulp) & model_moved
    assert only_accumulated.sum() > 100, int(only_accumulated.sum())


def test_bf16_resume_at_the_same_layout_is_bit_identical(results):
    """The fp32 main parameters are in the checkpoint: a bf16 run resumed after step 1 logs the
    uninterrupted run's steps 2 and 3 to the bit. Restarted from the bf16 weights alone, the update of
    step 2 starts from their rounding, and step 3's loss differs."""
    assert results["tp2_bf16_from_tp2_bf16"] == results["tp2_bf16"][1:]
    for step, (got, want) in enumerate(zip(results["tp2_bf16"], results["reference"]), start=1):
        assert got["loss"] == pytest.approx(want["loss"], rel=2e-2), f"bf16 step {step}"


def test_resume_at_another_layout(results):
    for resumed, uninterrupted in (("pp2_from_tp2", "pp2"), ("tp2_from_pp2", "tp2")):
        _close(results[resumed][0], results[uninterrupted][2], 1e-5, resumed)


@pytest.mark.parametrize("name", PACKED_RUNS)
def test_packed_rows_train_as_separate_rows(results, name):
    """A packed example that attended to the other one (across its boundary) would change the loss."""
    packed, unpacked = results[name]
    _close(packed, unpacked, 1e-5, f"{name}: packed vs unpacked")


def test_export_loads_in_transformers(results):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = Path(results["dir"]) / "final_reference"
    model = AutoModelForCausalLM.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    ids = tokenizer("the sum of 12 and 30 is 42", return_tensors="pt").input_ids
    assert torch.isfinite(model(ids).logits).all()
