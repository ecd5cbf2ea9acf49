"""Issue 27, at run time: fault injection on `recipes.train` (tiny random Llama, DeepSpeed ZeRO-3 on CPU
ranks over gloo), each test showing what is kept and what the user is told.

- a learning rate of 1e30: step 1's update blows the weights up while its loss is still finite; step
  2's loss is NaN. The run stops at step 2 with exit 3 naming the step and the values, metrics.jsonl
  stays strict JSON (null + "nonfinite"), and the checkpoint due at step 2 and the export are not
  written (they were before: NaN checkpoints pushed the good ones out, and `final/` was all NaN).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("deepspeed")

from tests.recipes.torchrun_helpers import launch, tiny_workspace  # noqa: E402

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("reliability")
    return root, tiny_workspace(root, problems=64, max_digits=2, hidden=32,
                                train={"steps": 4, "micro_batch_size": 4, "grad_accum": 1, "save_every": 2,
                                       "keep_last": 2, "tensorboard": False})


def _strict_rows(out):
    """metrics.jsonl read by a strict JSON parser (NaN, Infinity are refused)."""
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")
    return [json.loads(line, parse_constant=refuse) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _run(recipe, out, *overrides, nproc=1):
    proc = launch(recipe, out, *overrides, nproc=nproc)
    output, _ = proc.communicate(timeout=600)
    return proc.returncode, output


def test_a_non_finite_run_stops_with_exit_3_and_saves_nothing_after_the_last_good_step(workspace):
    root, recipe = workspace
    out = root / "nan"
    code, output = _run(recipe, out, "optim.lr=1e30")  # the rate: finite, so it loads
    assert code != 0 and "exitcode  : 3" in output, output[-3000:]
    assert "step 2: ce, loss, term/smmd, grad_norm" in output and "not finite; stopped without saving" in output, output[-3000:]
    assert "no checkpoint was written" in output
    rows = _strict_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[1]["loss"] is None and "loss" in rows[1]["nonfinite"] and "nonfinite" not in rows[0]
    assert not list((out / "checkpoints").glob("step_*"))  # save_every 2: step 2 was due, and refused
    assert not (out / "final").exists()
