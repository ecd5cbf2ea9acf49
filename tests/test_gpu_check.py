"""`benchmarks/gpu_run.sh --smoke`: the command a lent GPU runs, on CPU, so it has not rotted, and the GPU
check's correctness sections hold here too.

- The whole smoke run (one subprocess of the carried-wheels command): the wheels folder is checked against
  the pinned versions and installed into a private target (here stand-in wheels that carry only their
  metadata, so the real packages still import); OUT gets the four promised files and nothing else, the run
  archive holds logs and metrics but no checkpoint. The requirements table comes first; `losses` has its fused
  rows (the interpreter) beside the eager and torch ones, at a second vocabulary width too; `steps` has a row
  per engine, each measured beside a prediction; `kernels` runs three of tests/numloss/fused_interpreted.py's
  cases under Triton's interpreter through the same pytest/JUnit path the GPU's `-k cuda` cases take, and all
  pass; `packing` is a real check on both engines (one step over the same 24 examples as unpacked and as
  packed rows logs the same loss and gradient norm, rel 1e-4; a packed row that attended across an
  example's boundary would change both).
- What a bare GPU image meets: a triton that does not import skips `kernels` and `losses` still measures
  the eager and torch rows (exit 3: skipped, not failed); a failed kernel check marks the fused rows; a run
  whose section's time is spent is skipped with the reason; wrong carried wheels stop the command (exit 2)
  before the check starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_check  # noqa: E402
import gpu_check_requirements as req  # noqa: E402
import gpu_wheels  # noqa: E402
from gpu_check_kernels import FusedMode, junit_cases, losses_section  # noqa: E402
from gpu_check_runs import Clock, Run, Sizes, run_recipes  # noqa: E402

RUN_FILES = {"gpu_run.log", "gpu_check.json", "gpu_check.md", "runs.tar.gz"}


def stand_in_wheels(folder: Path, versions: dict[str, str]) -> Path:
    """A wheel of each carried distribution at its pinned version that installs only its metadata (so the
    packages this machine has still import), and the record `make gpu-wheels` writes beside them."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, version in versions.items():
        dist = f"{name.replace('-', '_')}-{version}"
        with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as z:
            files = {f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
                     f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                "Tag: py3-none-any\n"}
            for path, text in files.items():
                z.writestr(path, text)
            z.writestr(f"{dist}.dist-info/RECORD", "".join(f"{path},,\n" for path in [*files, f"{dist}.dist-info/RECORD"]))
    record = {gpu_wheels.wheel_of(w)[0]: {"file": w.name, "version": gpu_wheels.wheel_of(w)[1],
                                          "sha256": gpu_wheels.sha256(w), "bytes": w.stat().st_size}
              for w in folder.glob("*.whl")}
    (folder / gpu_wheels.RECORD).write_text(json.dumps(record))
    return folder


@pytest.mark.timeout(900)
def test_gpu_run_smoke_installs_the_wheels_runs_every_section_and_brings_back_four_files(tmp_path):
    pytest.importorskip("deepspeed")
    pytest.importorskip("megatron.core")
    pytest.importorskip("triton")
    wheels = stand_in_wheels(tmp_path / "wheels", gpu_wheels.pinned())
    out = tmp_path / "out"
    proc = subprocess.run(["bash", "benchmarks/gpu_run.sh", str(out), "--smoke", "--deadline-s", "840", "--wheels",
                           str(wheels)], cwd=REPO, env={**os.environ, "PYTHON": sys.executable}, capture_output=True,
                          text=True, timeout=880)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert {p.name for p in out.iterdir()} == RUN_FILES
    assert all(p.stat().st_size < 16 * 2**20 for p in out.iterdir())
    log = (out / "gpu_run.log").read_text()
    assert log == proc.stdout  # the log is everything printed
    installed = next(line for line in log.splitlines() if line.startswith("gpu_run: installed into "))
    for name, version in gpu_wheels.pinned().items():
        assert f"{name.replace('-', '_')}-{version}.dist-info" in installed, installed
    check_output = log.split("gpu_run: the check gets ", 1)[1]
    assert check_output.split("\n", 1)[1].lstrip().startswith("### requirements")  # before any section runs
    with tarfile.open(out / "runs.tar.gz") as archive:
        names = archive.getnames()
    assert any(n.endswith("steps-megatron-64/metrics.jsonl") for n in names), names
    assert any(n.endswith("steps-deepspeed-64/throughput.json") for n in names), names
    assert any(n.endswith("steps-deepspeed-64.log") for n in names), names
    assert not any("checkpoints" in n or n.endswith((".safetensors", ".pt", ".bin", ".parquet")) for n in names)

    report = json.loads((out / "gpu_check.json").read_text())
    sections = report["sections"]
    assert list(sections) == ["requirements", "losses", "steps", "kernels", "packing"]
    assert all(s["ok"] and not s.get("skipped") for s in sections.values()), {
        n: (s["ok"], s.get("skipped")) for n, s in sections.items()}
    assert report["requirements"]["sections"] == {"kernels": None, "losses": None, "packing": None, "steps": None}

    kernels = {r["case"]: r["outcome"] for r in sections["kernels"]["rows"]}
    assert len(kernels) == 3 and set(kernels.values()) == {"passed"}, kernels

    losses = sections["losses"]
    assert losses["fused"] is True
    paths = {(r["V"], r.get("N"), r["path"]) for r in losses["rows"]}
    assert {(1200, 10, "numloss CE, grad in place"), (1200, 10, "numloss CE+ntil"), (1200, 1000, "numloss CE+smmd"),
            (1500, None, "numloss CE"), (1500, None, "numloss CE, grad in place")} <= paths
    assert (1200, 1000, "numloss CE+ntil") not in paths and not any(p[0] == 1500 and "+" in p[2] for p in paths)
    assert not any(r.get("note") for r in losses["rows"])  # the kernel check passed: no note left on the rows

    packing = {r["engine"]: r for r in sections["packing"]["rows"]}
    assert set(packing) == {"megatron", "deepspeed"}
    for row in packing.values():
        assert row["equal"] is True and row["rel_loss"] <= 1e-4 and row["rel_grad_norm"] <= 1e-4, row
        assert row["packed_rows"] < row["examples"]  # several examples per packed row: the check means something

    steps = {r["engine"]: r for r in sections["steps"]["rows"]}
    assert set(steps) == {"megatron", "deepspeed"}
    for engine, row in steps.items():
        assert row["measured_step_s"] > 0 and row["predicted_step_s"] is not None and row["measured_tflops"] > 0, row
        assert row["measured_tokens_per_s"] == pytest.approx(row["tokens_per_step"] / row["measured_step_s"])
        assert row["step_vs_predicted"] == pytest.approx(row["measured_step_s"] / row["predicted_step_s"])
    assert "layer spec local (auto: no GPU)" in steps["megatron"]["layout"]
    assert steps["deepspeed"]["layout"].startswith("deepspeed, optimizer torch")
    assert (out / "gpu_check.md").read_text().count("###") == 5


def test_wrong_carried_wheels_stop_the_command_before_the_check(tmp_path):
    versions = gpu_wheels.pinned()
    wheels = stand_in_wheels(tmp_path / "wheels", {**versions, "megatron-core": "0.15.0"})
    out = tmp_path / "out"
    proc = subprocess.run(["bash", "benchmarks/gpu_run.sh", str(out), "--smoke", "--wheels", str(wheels)], cwd=REPO,
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"megatron_core-0.15.0-py3-none-any.whl is not the pinned megatron-core=={versions['megatron-core']}" \
        in proc.stdout
    assert "gpu_run: the check gets" not in proc.stdout and not (out / "gpu_check.json").exists()


def test_the_wheels_check_names_what_is_missing_doubled_or_changed(tmp_path):
    versions = gpu_wheels.pinned()
    assert set(versions) == set(gpu_wheels.CARRIED) and versions["megatron-core"] == "0.16.1"
    assert versions["deepspeed"] == "0.19.8"
    folder = stand_in_wheels(tmp_path / "w", versions)
    assert gpu_wheels.check(folder, versions) == []
    (folder / "hjson-3.1.0-py3-none-any.whl").unlink()
    extra = stand_in_wheels(tmp_path / "x", {"pydantic": "2.0.0", "numpy": "2.0.0"})
    for name in ("pydantic-2.0.0-py3-none-any.whl", "numpy-2.0.0-py3-none-any.whl"):
        (extra / name).rename(folder / name)
    problems = gpu_wheels.check(folder, versions)
    assert f"no wheel of hjson=={versions['hjson']} in {folder}" in problems
    assert any(p.startswith("2 wheels of pydantic in ") and "keep one" in p for p in problems), problems
    assert "numpy-2.0.0-py3-none-any.whl: not a carried distribution" in problems
    with zipfile.ZipFile(folder / f"typing_inspection-{versions['typing-inspection']}-py3-none-any.whl", "a") as z:
        z.writestr("extra.txt", "changed after the record was written")
    assert any("does not match its sha256" in p for p in gpu_wheels.check(folder, versions))
    assert gpu_wheels.check(tmp_path / "none", versions)[0].endswith("run `make gpu-wheels` where pip reaches the index")


def test_each_section_ends_by_its_share_and_a_short_one_leaves_its_time_to_the_next():
    clock = Clock(400.0)
    assert list(clock.shares)[1:] == list(gpu_check.SECTIONS) == ["losses", "steps", "kernels", "packing"]
    assert sum(clock.shares.values()) == pytest.approx(1.0)
    ends = [clock.section_deadline(name) - clock.start for name in clock.shares]
    assert ends == sorted(ends) and ends[-1] == pytest.approx(400.0)
    assert ends[1] == pytest.approx(400.0 * (clock.shares["requirements"] + clock.shares["losses"]))
    # the end of each share is fixed from the start: a section that finishes early hands the rest on
    clock.start -= 50.0
    assert clock.section_deadline("steps") == pytest.approx(clock.start + ends[2])


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
    rows = {(r.get("V"), r.get("N"), r["path"]): r for r in losses["rows"]}
    assert rows[1200, 10, "numloss CE eager"]["ms"] > 0 and rows[1200, 10, "torch eager CE (fp32 upcast)"]["ms"] > 0
    assert rows[1200, 10, "numloss CE"]["note"] == "eager pass (triton does not import)"
    fused = rows[None, None, "numloss fused paths (CE, grad in place, terms)"]
    assert fused["note"] == "not measured: triton does not import"
    assert (1200, 10, "numloss CE, grad in place") not in rows


@pytest.mark.timeout(300)
def test_a_failed_kernel_check_leaves_the_fused_rows_unmeasured(tmp_path):
    mode = FusedMode.after({"ok": False, "rows": [{"outcome": "failed"}]}, triton_ok=True)
    assert (mode.run, mode.note) == (False, "kernel check failed")
    not_run = FusedMode(True, "kernel check not run")
    assert FusedMode.after({"ok": True, "skipped": "every case skipped"}, True) == not_run
    assert FusedMode.after({"ok": True}, True) == FusedMode(True, None)
    section = losses_section(Sizes.of(True, 1), tmp_path, 240, mode)
    assert section["ok"] and section["fused"] is False
    notes = {(r.get("V"), r.get("N"), r["path"]): r.get("note") for r in section["rows"]}
    assert notes[1200, 1000, "numloss CE+smmd"] == "eager pass (kernel check failed)"
    assert notes[1200, 1000, "numloss CE eager"] is None and notes[1200, 1000, "torch eager CE (fp32 upcast)"] is None
    assert notes[None, None, "numloss fused paths (CE, grad in place, terms)"] == "not measured: kernel check failed"
    # the GPU order: the fused rows are timed before the kernel check, whose failure then marks them
    losses = {"fused": True, "ok": True, "rows": [{"path": "numloss CE", "note": "kernel check not run"},
                                                  {"path": "numloss CE eager"}]}
    gpu_check.mark_fused_rows(losses, {"ok": False, "rows": [{"outcome": "failed"}]})
    assert losses["ok"] is False and losses["rows"][0]["note"].startswith("the kernel check failed")
    assert "note" not in losses["rows"][1]


def test_the_loss_pass_keeps_the_blocks_it_measured_when_its_time_runs_out(tmp_path, monkeypatch):
    """The table is handed over after every block (shape, N), so the worker cut off at its section's share
    leaves those rows, and the section reads them as measured-then-cut rather than as an error."""
    import gpu_check_kernels
    from bench_gpu_losses import LossSizes, losses_table

    import torch

    seen = []
    table = losses_table(LossSizes("cpu", torch.float32, (1, 4, 1200), 1, (), (1300,)),
                         on_block=lambda t: seen.append([(r["V"], r["N"]) for r in t["rows"]]))
    assert [len(rows) for rows in seen] == sorted(len(rows) for rows in seen) and len(seen) == 3
    assert set(seen[0]) == {(1200, 10)} and (1200, 1000) in seen[1] and (1300, None) in seen[2]
    assert seen[-1] == [(r["V"], r["N"]) for r in table["rows"]]

    def cut_after_one_block(cmd, env, timeout_s, log):  # the worker's file as it stood when the timeout hit
        out = Path(cmd[cmd.index("--out") + 1])
        out.write_text(json.dumps({**table, "rows": [r for r in table["rows"] if r["N"] == 10]}))
        return None, "killed at the timeout"
    monkeypatch.setattr(gpu_check_kernels, "_run", cut_after_one_block)
    section = losses_section(Sizes.of(True, 1), tmp_path, 12, FusedMode(True, None))
    assert section["ok"] and section["skipped"].startswith("cut at 12 s")
    assert {r["N"] for r in section["rows"]} == {10}


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


def test_a_run_is_not_started_when_its_section_has_no_time_left(tmp_path):
    spent = Run({}, tmp_path / "mg")
    done = []
    run_recipes([spent], timeout_s=60, section_deadline=time.time() + 5, min_run_s=30, parallel=1, on_done=done.append)
    assert done == [spent] and spent.status is None and spent.error is None
    assert spent.skipped.startswith("not started: ") and "left of the section's time budget" in spent.skipped
    assert not (tmp_path / "mg").exists()  # it never started


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
