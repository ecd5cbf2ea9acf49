"""`benchmarks/gpu_check.py --smoke`: the GPU check's code paths on CPU, so the script a lent GPU runs
has not rotted, and its one correctness section holds here too.

The packing section is a real check on both engines: one step over the same 24 examples as unpacked rows
and as packed rows (several examples per row) logs the same loss, CE and gradient norm (rel 1e-4; on
CPU the Megatron engine's block mask and DeepSpeed's sdpa mask keep the examples apart). A packed row
that attended across an example's boundary would change all three. The other sections must produce
their rows: the loss paths with a ratio each, and both engines' measured step beside a prediction.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("megatron.core")

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(900)
def test_gpu_check_smoke_runs_every_section_and_packed_rows_equal_unpacked(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--smoke", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = report["sections"]
    assert set(sections) == {"losses", "steps", "packing"} and all(s["ok"] for s in sections.values())
    packing = {r["engine"]: r for r in sections["packing"]["rows"]}
    assert set(packing) == {"megatron", "deepspeed"}
    for row in packing.values():
        assert row["equal"] is True and row["rel_loss"] <= 1e-4 and row["rel_grad_norm"] <= 1e-4, row
        assert row["packed_rows"] < row["examples"]  # several examples per packed row: the check means something
    paths = {(r["N"], r["path"]) for r in sections["losses"]["rows"]}
    assert (10, "numloss CE+ntil") in paths and (1000, "numloss CE+smmd") in paths and (1000, "numloss CE+ntil") not in paths
    steps = {r["engine"]: r for r in sections["steps"]["rows"]}
    assert set(steps) == {"deepspeed", "megatron"}
    for row in steps.values():
        assert row["measured_step_s"] > 0 and row["predicted_step_s"] is not None and row["measured_tflops"] > 0, row
    assert (tmp_path / "gpu_check.md").read_text().count("###") == 3
