"""recipes.engines.deepspeed.runtime.checkpoints.convert_once: rank 0 converts a checkpoint to DeepSpeed's universal
format in a subprocess with its own timeout, keeps a failed attempt's partial output, and the other ranks
wait on the process group's store (not in a collective that times out after train.dist_timeout_minutes)
and fail with rank 0's message. 2 gloo ranks; the converter is a stand-in command (the real
ds_to_universal conversion is tested by tests/recipes/test_train_layouts.py's DP-change resume).

`load_failure_hint`: the advice of a checkpoint that does not load sends the user to an older checkpoint
("point latest at ...") only when the checkpoint may be damaged, never when it holds another model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from recipes.engines.deepspeed.runtime import checkpoints as C
from recipes.engines.deepspeed.runtime.checkpoints import load_failure_hint
from tests.distributed import run_ranks

FAKE = ("import os, sys, time; out, mode = sys.argv[1], sys.argv[2]; os.makedirs(out, exist_ok=True); "
        "open(os.path.join(out, 'part'), 'w').write('x'); time.sleep(30 if mode == 'slow' else 0); "
        "sys.exit(3 if mode == 'fail' else 0)")


def _fake(mode: str):
    return lambda src, out, workers: [sys.executable, "-c", FAKE, str(out), mode]


def _rank(rank: int, world: int, root: str, mode: str) -> None:
    src, dst = Path(root, "step_00000004"), Path(root, "step_00000004_universal")
    try:
        C.convert_once(src, dst, rank == 0, command=_fake(mode), timeout_s=3)
        result = "ok"
    except RuntimeError as err:
        result = str(err)
    Path(root, f"rank{rank}.json").write_text(json.dumps(result))


def _results(tmp_path, mode):
    (tmp_path / "step_00000004").mkdir()
    run_ranks(2, _rank, str(tmp_path), mode)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_converted_once_and_every_rank_proceeds(tmp_path):
    assert _results(tmp_path, "ok") == ["ok", "ok"]
    assert (tmp_path / "step_00000004_universal" / "part").is_file()
    assert not (tmp_path / ".step_00000004_universal.partial").exists()


def test_a_failed_conversion_keeps_its_partial_output_and_fails_every_rank(tmp_path):
    r0, r1 = _results(tmp_path, "fail")
    assert "CalledProcessError" in r0 and r1 == f"rank 0: {r0}"
    assert (tmp_path / ".step_00000004_universal.partial" / "part").is_file()  # kept for a rerun
    assert not (tmp_path / "step_00000004_universal").exists()


def test_a_conversion_past_its_own_timeout_fails_every_rank(tmp_path):
    r0, r1 = _results(tmp_path, "slow")
    assert "TimeoutExpired" in r0 and r1.startswith("rank 0: ")
    assert (tmp_path / ".step_00000004_universal.partial" / "part").is_file()


def test_the_deadline_scales_with_the_checkpoint_and_several_workers_convert(tmp_path):
    assert C.conversion_timeout_s(850e9) > 2 * C.conversion_timeout_s(100e9) > 600
    cmd = C.ds_to_universal_command(tmp_path / "a", tmp_path / "b", 8)
    assert cmd[cmd.index("--num_extract_workers") + 1] == "8" and cmd[cmd.index("--num_merge_workers") + 1] == "4"


def test_a_checkpoint_of_another_model_is_not_sent_to_an_older_checkpoint(tmp_path):
    wider = torch.nn.Linear(4, 8).state_dict()
    with pytest.raises(RuntimeError) as mismatch:  # torch's own error for another width
        torch.nn.Linear(4, 4).load_state_dict(wider)
    step = tmp_path / "checkpoints" / "step_00000004"
    hint = load_failure_hint(mismatch.value, step)
    assert "holds another model than this recipe builds" in hint and "latest" not in hint
    assert str(tmp_path / "recipe.yaml") in hint
    damaged = load_failure_hint(RuntimeError("PytorchStreamReader failed reading zip archive"), step)
    assert f"echo step_XXXXXXXX > {tmp_path / 'checkpoints' / 'latest'}" in damaged
