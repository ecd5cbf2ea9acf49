"""recipes.train end to end: 2-rank DeepSpeed ZeRO-3 on CPU (gloo), a tiny random Llama on generated
arithmetic built through data_prep. The runs whose properties are numbers train in pre-started ranks
(`run_in_ranks`); the killed run and its restart are real torchrun jobs (the property is a process's).

- training lowers the loss; the exported safetensors model equals the checkpoint's fp32 weights
  (recovered independently with DeepSpeed's zero_to_fp32) and loads into a fresh model;
- a run killed with SIGKILL at a random step, then restarted with the same command, logs exactly the
  losses of the uninterrupted run, to the bit;
- bf16 on CPU trains with either head and exports bf16 weights.
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

pytest.importorskip("deepspeed")

from tests.recipes.torchrun_helpers import (kill_after_logged_steps, launch, read_metrics, run_in_ranks,  # noqa: E402
                                           run_to_end, tiny_workspace)

STEPS = 8


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    return root, tiny_workspace(root, problems=256, max_digits=3, module="add_or_sub", terms=("smmd", "ntl_was"),
                                optim={"lr": 3e-3, "warmup_steps": 2},
                                train={"steps": STEPS, "micro_batch_size": 8, "grad_accum": 2, "save_every": 2,
                                       "keep_last": 2})


@pytest.fixture(scope="module")
def reference_run(workspace):
    root, recipe = workspace
    out = root / "reference"
    run_in_ranks(recipe, out)
    return out


def test_training_lowers_the_loss_and_exports_the_trained_weights(reference_run):
    rows = read_metrics(reference_run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert {"loss", "ce", "term/smmd", "term/ntl_was", "lr", "grad_norm", "tokens_per_s"} <= set(rows[0])
    first, last = sum(r["loss"] for r in rows[:2]) / 2, sum(r["loss"] for r in rows[-2:]) / 2
    assert last < first - 0.1, (first, last)
    assert rows[0]["lr"] == pytest.approx(1.5e-3)  # warmup: half the peak at the first step
    # what the hardware did (recipes.training.throughput): TFLOP/s per rank, no MFU on CPU, the time split
    # (DeepSpeed exposes forward+backward and the optimizer), the peak resident memory over the 2 ranks
    for r in rows:
        assert r["tflops_per_rank"] > 0 and r["mfu"] is None and r["peak_mem_gib"] > 0.05
        assert r["data_s"] + r["fwd_bwd_s"] + r["optimizer_s"] <= r["step_s"] * 1.01
    summary = json.loads((reference_run / "throughput.json").read_text())
    assert summary["device"] == "cpu" and len(summary["measured"]["peak_mem_gib_per_rank"]) == 2
    assert summary["predicted"]["step_s"] > 0 and summary["predicted"]["memory_gib"] > 0

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM

    from recipes.reliability.export_writer import read_export

    checkpoint = get_fp32_state_dict_from_zero_checkpoint(str(reference_run / "checkpoints"))
    exported = read_export(reference_run / "final")  # 2 ranks: 2 shards + transformers' index
    assert set(exported) == {k.removeprefix("model.") for k in checkpoint}
    for name, value in checkpoint.items():
        assert torch.equal(exported[name.removeprefix("model.")], value), name
    model = AutoModelForCausalLM.from_pretrained(str(reference_run / "final"))
    for name, value in model.state_dict().items():
        assert torch.equal(value, exported[name]), name
    # keep_last 2: only the two newest checkpoints remain, and latest names the final one
    tags = sorted(p.name for p in (reference_run / "checkpoints").glob("step_*"))
    assert tags == [f"step_{STEPS - 2:08d}", f"step_{STEPS:08d}"]
    assert (reference_run / "checkpoints" / "latest").read_text() == f"step_{STEPS:08d}"


def test_resume_after_kill_gives_the_uninterrupted_losses_to_the_bit(workspace, reference_run):
    root, recipe = workspace
    out = root / "killed"
    kill_after = random.Random().randint(3, STEPS - 1)  # a random point: after or between checkpoints
    proc = launch(recipe, out, log=root / "killed.log")
    kill_after_logged_steps(proc, out, kill_after)
    assert len(read_metrics(out)) < STEPS

    output = run_to_end(recipe, out)
    assert "resumed tiny from step" in output, f"killed after {kill_after} logged steps:\n{output[-3000:]}"
    resumed, reference = read_metrics(out), read_metrics(reference_run)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    for got, want in zip(resumed, reference):
        for key in ("loss", "ce", "term/smmd", "term/ntl_was", "grad_norm", "lr"):
            assert got[key] == want[key], (f"step {got['step']} {key}: {got[key]!r} != {want[key]!r}"
                                           f" (killed after {kill_after} logged steps)")


def test_bf16_training_on_cpu_lowers_the_loss_and_both_heads_agree(workspace, reference_run):
    """model.dtype bfloat16 (DeepSpeed bf16: bf16 weights and activations, fp32 master weights): the
    loss falls, the chunked head follows the logits path within bf16 rounding, the export is bf16."""

    root, recipe = workspace
    runs = {}
    for head in ("logits", "chunked"):
        out = root / f"bf16-{head}"
        run_in_ranks(recipe, out, "model.dtype=bfloat16", f"loss.head={head}", "train.save_every=0",
                     "train.tensorboard=false")
        runs[head] = read_metrics(out)
    logits, chunked = runs["logits"], runs["chunked"]
    assert [r["step"] for r in logits] == [r["step"] for r in chunked] == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["loss"]) for r in logits + chunked)
    assert sum(r["loss"] for r in logits[-2:]) < sum(r["loss"] for r in logits[:2]) - 0.2
    for a, b in zip(logits, chunked):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-3), a["step"]
    # the fp32 run of the same recipe starts at the same loss, up to bf16 rounding
    assert logits[0]["loss"] == pytest.approx(read_metrics(reference_run)[0]["loss"], rel=2e-2)
    from recipes.reliability.export_writer import read_export

    exported = read_export(root / "bf16-logits" / "final")
    assert {v.dtype for v in exported.values()} == {torch.bfloat16}


def test_zero_stages_and_cpu_offload_train_the_same_model(workspace, reference_run):
    """The DeepSpeed knobs change where state lives, not the training: ZeRO-3 with optimizer and
    parameter offload (DeepSpeed's CPU Adam) logs the ZeRO-3 reference's losses; ZeRO-2 logs ZeRO-0's
    (stages 0-2 build the model unpartitioned, so their random init differs from ZeRO-3's)."""
    root, recipe = workspace
    fast = ("train.save_every=0", "train.tensorboard=false", "train.export=false")
    runs = {}
    for name, overrides in {"offload": ("deepspeed.offload_optimizer=true", "deepspeed.offload_params=true"),
                            "zero2": ("deepspeed.zero_stage=2",), "zero0": ("deepspeed.zero_stage=0",)}.items():
        run_in_ranks(recipe, root / name, *overrides, *fast)
        runs[name] = read_metrics(root / name)
    reference = read_metrics(reference_run)
    for a, b in zip(reference, runs["offload"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["lr"] == a["lr"], a["step"]
    for a, b in zip(runs["zero0"], runs["zero2"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), a["step"]
    # stage 0: DeepSpeed keeps no norm with a torch optimizer; the engine measures it, as ZeRO-2 reports it
    for a, b in zip(runs["zero0"], runs["zero2"]):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), a["step"]
    assert all(r["grad_norm"] > 0 for r in runs["zero2"] + runs["offload"])
    assert len(runs["zero0"]) == len(runs["offload"]) == STEPS
