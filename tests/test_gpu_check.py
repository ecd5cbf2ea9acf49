"""`benchmarks/gpu_check.py --smoke`: the GPU check's code paths on CPU, so the script a lent GPU runs
has not rotted, and its correctness sections hold here too.

- The whole smoke run (one subprocess): the requirements table first; `kernels` runs three of
  tests/numloss/fused_interpreted.py's cases under Triton's interpreter through the same pytest/JUnit path
  the GPU's `-k cuda` cases take, and all pass; `losses` has its fused rows (the interpreter) beside the
  eager and torch ones; `packing` is a real check on both engines (one step over the same 24 examples as
  unpacked and as packed rows logs the same loss and gradient norm, rel 1e-4; a packed row that attended
  across an example's boundary would change both); `steps` has the dense and the MoE (tiny qwen3_moe) rows
  on both engines, each measured beside a prediction, the MoE rows with router/aux near its balanced value.
- What a bare GPU image meets: a triton that does not import skips `kernels` with the reason and `losses`
  still measures the eager and torch rows (exit 3: skipped, not failed); a failed kernel check turns the
  fused rows into "kernel check failed"; a DeepSpeed run whose FusedAdam build times out fails with the
  reason, and a run whose section's time is spent is skipped with it; neither is started.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_check_requirements as req  # noqa: E402
from gpu_check_kernels import FusedMode, junit_cases, losses_section  # noqa: E402
from gpu_check_runs import Prebuild, Run, Sizes, run_recipes  # noqa: E402


@pytest.mark.timeout(600)
def test_gpu_check_smoke_runs_every_section_and_packed_rows_equal_unpacked(tmp_path):
    pytest.importorskip("deepspeed")
    pytest.importorskip("megatron.core")
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--smoke", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.lstrip().startswith("### requirements")  # printed before any section runs
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = report["sections"]
    assert list(sections) == ["requirements", "kernels", "losses", "packing", "steps"]
    assert all(s["ok"] and not s.get("skipped") for s in sections.values())
    assert report["requirements"]["sections"] == {"kernels": None, "losses": None, "packing": None, "steps": None}

    kernels = {r["case"]: r["outcome"] for r in sections["kernels"]["rows"]}
    assert len(kernels) == 3 and set(kernels.values()) == {"passed"}, kernels

    losses = sections["losses"]
    assert losses["fused"] is True
    paths = {(r["N"], r["path"]) for r in losses["rows"]}
    assert {(10, "numloss CE, grad in place"), (10, "numloss CE+ntil"), (1000, "numloss CE+smmd")} <= paths
    assert (1000, "numloss CE+ntil") not in paths and not any(r.get("note") for r in losses["rows"])

    packing = {r["engine"]: r for r in sections["packing"]["rows"]}
    assert set(packing) == {"megatron", "deepspeed"}
    for row in packing.values():
        assert row["equal"] is True and row["rel_loss"] <= 1e-4 and row["rel_grad_norm"] <= 1e-4, row
        assert row["packed_rows"] < row["examples"]  # several examples per packed row: the check means something

    steps = {(r["model"].split()[0], r["engine"]): r for r in sections["steps"]["rows"]}
    assert set(steps) == {(m, e) for m in ("Llama-3-8B", "Qwen3-30B-A3B") for e in ("megatron", "deepspeed")}
    for (model, engine), row in steps.items():
        assert row["measured_step_s"] > 0 and row["predicted_step_s"] is not None and row["measured_tflops"] > 0, row
        if model == "Qwen3-30B-A3B":
            # router/aux = coeff x sum over the 2 layers of E/(k T^2) sum_e P_e c_e: 1 per layer for balanced
            # routing, E/k = 4 at the most; random init routes nearly balanced, so ~0.001 x 2
            for value in (row["router_aux_first"], row["router_aux_last"]):
                assert 0.8 * 0.002 < value < 1.5 * 0.002, row
        else:
            assert "router_aux_first" not in row
    assert "megatron MoE" not in steps["Llama-3-8B", "megatron"]["layout"]
    assert "dispatcher allgather" in steps["Qwen3-30B-A3B", "megatron"]["layout"]  # CPU: auto = allgather
    assert (tmp_path / "gpu_check.md").read_text().count("###") == 5


@pytest.mark.timeout(300)
def test_a_triton_that_does_not_import_skips_kernels_and_losses_measures_the_eager_rows(tmp_path):
    broken = tmp_path / "site" / "triton"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('triton built for another torch (planted by the test)')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--smoke", "--sections", "kernels,losses",
                           "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 3, proc.stdout[-4000:] + proc.stderr[-4000:]  # skipped, nothing failed
    assert "Traceback" not in proc.stdout
    report = json.loads((out / "gpu_check.json").read_text())
    assert "planted by the test" in report["found"]["triton"]["error"]
    kernels, losses = report["sections"]["kernels"], report["sections"]["losses"]
    assert kernels["ok"] and kernels["skipped"] == "needs triton" and kernels["rows"] == []
    assert losses["ok"] and losses["fused"] is False and not losses.get("skipped")
    rows = {(r.get("N"), r["path"]): r for r in losses["rows"]}
    assert rows[10, "numloss CE eager"]["ms"] > 0 and rows[10, "torch eager CE (fp32 upcast)"]["ms"] > 0
    assert rows[10, "numloss CE"]["note"] == "eager pass (triton does not import)"
    fused = rows[None, "numloss fused paths (CE, grad in place, terms)"]
    assert fused["note"] == "not measured: triton does not import"
    assert (10, "numloss CE, grad in place") not in rows


@pytest.mark.timeout(300)
def test_a_failed_kernel_check_leaves_the_fused_rows_unmeasured(tmp_path):
    mode = FusedMode.after({"ok": False, "rows": [{"outcome": "failed"}]}, triton_ok=True)
    assert (mode.run, mode.note) == (False, "kernel check failed")
    not_run = FusedMode(True, "kernel check not run")
    assert FusedMode.after({"ok": True, "skipped": "every case skipped"}, True) == not_run
    assert FusedMode.after({"ok": True}, True) == FusedMode(True, None)
    section = losses_section(Sizes.of(True, 1, 1), tmp_path, 240, mode)
    assert section["ok"] and section["fused"] is False
    notes = {(r.get("N"), r["path"]): r.get("note") for r in section["rows"]}
    assert notes[1000, "numloss CE+smmd"] == "eager pass (kernel check failed)"
    assert notes[1000, "numloss CE eager"] is None and notes[1000, "torch eager CE (fp32 upcast)"] is None
    assert notes[None, "numloss fused paths (CE, grad in place, terms)"] == "not measured: kernel check failed"


def test_junit_cases_reads_each_outcome(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text('<?xml version="1.0"?><testsuites><testsuite>'
                   '<testcase classname="t" name="a[10-None]" time="1.5"/>'
                   '<testcase classname="t" name="b" time="0.2"><failure message="assert 3 == 4">trace</failure>'
                   '</testcase><testcase classname="t" name="c" time="0"><skipped message="needs a CUDA GPU"/>'
                   '</testcase><testcase classname="t" name="d" time="0"><error message="fixture broke"/></testcase>'
                   '</testsuite></testsuites>')
    assert junit_cases(xml) == [
        {"case": "a[10-None]", "outcome": "passed", "seconds": 1.5, "message": None},
        {"case": "b", "outcome": "failed", "seconds": 0.2, "message": "assert 3 == 4"},
        {"case": "c", "outcome": "skipped", "seconds": 0.0, "message": "needs a CUDA GPU"},
        {"case": "d", "outcome": "error", "seconds": 0.0, "message": "fixture broke"}]


def _found(*absent: str) -> dict:
    ok = {name: {"ok": True, "version": "1"} for name in [*req.MODULES, "cuda"]}
    return {**ok, **{name: {"ok": False, "error": f"ModuleNotFoundError: {name}"} for name in absent}}


def test_requirements_skip_what_cannot_run_and_name_why():
    # a bare GPU image: torch, triton, pytest; no engines
    bare = _found("deepspeed", "megatron.core", "transformer_engine", "flash_attn", "liger_kernel")
    skips = req.section_skips(bare, smoke=False)
    assert skips["kernels"] is None and skips["losses"] is None
    assert "deepspeed (ModuleNotFoundError: deepspeed)" in skips["steps"] and "megatron.core" in skips["packing"]
    # one engine missing: its rows are skipped, the section runs
    engines = req.engine_skips(_found("megatron.core"))
    assert engines["deepspeed"] is None and "megatron.core" in engines["megatron"]
    assert req.section_skips(_found("megatron.core"), smoke=False)["steps"] is None
    # optional components never skip anything
    assert set(req.section_skips(_found("transformer_engine", "flash_attn", "liger_kernel"), False).values()) == {None}
    # no CUDA: every section needs it at GPU sizes; --smoke runs them on CPU
    assert all(req.section_skips(_found("cuda"), smoke=False).values())
    assert not any(req.section_skips(_found("cuda"), smoke=True).values())
    assert req.section_skips(_found("pytest"), smoke=True)["kernels"] == "needs pytest"
    # another deepspeed than the pinned one is a note, not a skip
    found = _found()
    found["deepspeed"]["version"] = "0.18.0"
    table = req.requirements_table(found, smoke=False)
    row = next(r for r in table["rows"] if r["component"] == "deepspeed")
    assert row["note"] == "the project pins/tests 0.19.8; found 0.18.0" and table["engines"]["deepspeed"] is None


@pytest.mark.timeout(120)
def test_deepspeed_runs_wait_for_the_build_and_fail_when_it_times_out(tmp_path):
    build = Prebuild(tmp_path, cuda=False, timeout_s=0.0)  # a real process, given no time
    late = Run({}, tmp_path / "ds", after=build)
    spent = Run({}, tmp_path / "mg")
    t0 = time.time()
    run_recipes([late, spent], timeout_s=60, section_deadline=time.time() + 5, min_run_s=30, parallel=1)
    assert time.time() - t0 < 30
    # a build that fails or times out leaves DeepSpeed's GPU optimizer unbuilt: an error, not a skip
    assert late.skipped is None and late.status is None
    assert late.error.startswith("waited for deepspeed import") and "did not finish in 0 s" in late.error
    assert spent.skipped.startswith("not started: ") and "left of the section's time budget" in spent.skipped
    assert build.proc.poll() is not None  # its process group was killed
    assert not (tmp_path / "ds").exists() and not (tmp_path / "mg").exists()  # neither run started


@pytest.mark.timeout(200)
def test_requirements_alone_prints_the_table_and_exits_3_when_a_section_would_be_skipped(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this checks the answer on a machine without a GPU")
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--requirements", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = json.loads((tmp_path / "requirements.json").read_text())
    assert set(table["sections"]) == {"kernels", "losses", "packing", "steps"}
    assert all(reason.startswith("needs cuda") for reason in table["sections"].values())
    assert "| section kernels | skipped |  | needs cuda" in proc.stdout
    assert not (tmp_path / "gpu_check.json").exists()  # nothing ran
