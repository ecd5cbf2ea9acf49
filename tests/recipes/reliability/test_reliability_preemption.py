"""Issue 27, preemption on a real 2-rank torchrun job (tiny Llama, DeepSpeed ZeRO-3, gloo), save_every 0
and 400 steps, so before this nothing was saved: SIGTERM killed the run in 0.6 s with exit 1 and every
step was lost.

1. `<out_dir>/PREEMPT` appears (the SLURM template's trap writes it when `--signal=B:USR1@N` arrives
   ahead of the time limit). Only rank 0 looks for it; rank 1 learns of it through the step's
   all-reduce. Both finish the step, save it, and exit 75; `latest` names that step and the file is gone.
2. The same command resumes from that step; SIGTERM to torchrun (what srun sends on a preemption):
   torchrun passes it on, the ranks save the step they were in and exit 75 again. metrics.jsonl holds
   every step once, up to the second checkpoint.
"""

from __future__ import annotations

import json
import signal
import time

import pytest

pytest.importorskip("deepspeed")

from tests.recipes.torchrun_helpers import launch, read_metrics, tiny_workspace  # noqa: E402

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    root = tmp_path_factory.mktemp("preemption")
    return root, tiny_workspace(root, problems=64, max_digits=2, hidden=32,
                                train={"steps": 400, "max_epochs": 400, "micro_batch_size": 2, "grad_accum": 1,
                                       "save_every": 0, "tensorboard": False, "export": False})


def _wait_for_rows(proc, out, rows, timeout=600):
    deadline = time.time() + timeout
    metrics = out / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= rows):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.time() < deadline
        time.sleep(0.05)


def _latest(out) -> int:
    return int((out / "checkpoints" / "latest").read_text().split("_")[1])


def test_preemption_saves_the_current_step_on_every_rank_and_resumes_from_it(recipe):
    root, path = recipe
    out = root / "run"
    proc = launch(path, out)
    _wait_for_rows(proc, out, 3)
    (out / "PREEMPT").touch()  # the batch script's trap
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0 and "exitcode  : 75" in output, output[-3000:]
    first = _latest(out)
    assert f"preempted ({out / 'PREEMPT'} exists) after step {first}" in output, output[-3000:]
    assert "preempted (asked on another rank)" in output  # rank 1 learnt it through the all-reduce
    assert 3 <= first < 400 and not (out / "PREEMPT").exists()
    step_dir = out / "checkpoints" / f"step_{first:08d}"
    assert (step_dir / "rank_00000.pt").is_file() and (step_dir / "rank_00001.pt").is_file()
    assert [r["step"] for r in read_metrics(out)] == list(range(1, first + 1))

    proc = launch(path, out, log=root / "second.log")
    _wait_for_rows(proc, out, first + 2)
    proc.send_signal(signal.SIGTERM)  # to torchrun, as srun/SLURM preemption does
    proc.wait(timeout=300)
    output = (root / "second.log").read_text()
    assert f"resumed tiny from step {first}" in output, output[-3000:]
    second = _latest(out)
    assert f"preempted (SIGTERM) after step {second}" in output, output[-3000:]
    assert second >= first + 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, second + 1))  # each step once, none lost
