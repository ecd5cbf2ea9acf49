"""The suite's multi-process helper (`tests.distributed.run_ranks`): what a rank does reaches the test."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing import ProcessRaisedException

from tests.distributed import run_ranks


def _sum_of_ranks(rank: int, world: int, out: str) -> None:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    if rank == 0:
        with open(out, "w") as f:
            f.write(f"{t.item()} {os.environ.get('NUMLOSS_TEST_MARK')}")


def test_ranks_join_one_group_and_see_the_callers_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMLOSS_TEST_MARK", "set-after-the-server-started")
    run_ranks(3, _sum_of_ranks, str(tmp_path / "out"))
    assert (tmp_path / "out").read_text() == "6.0 set-after-the-server-started"


def _speak(rank: int, world: int) -> None:
    print(f"stdout of rank {rank}", flush=True)
    print(f"stderr of rank {rank}", file=sys.stderr, flush=True)


def test_a_ranks_output_reaches_the_callers_capture(capfd):
    run_ranks(2, _speak)
    out, err = capfd.readouterr()
    assert "stdout of rank 0" in out and "stdout of rank 1" in out
    assert "stderr of rank 0" in err and "stderr of rank 1" in err


def _fail_on_rank_1(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 found a bad shard")


def test_a_failing_rank_fails_the_caller_with_its_error_first():
    """Rank 0's barrier then breaks too (gloo: connection reset); the error that caused it comes first."""
    with pytest.raises(ProcessRaisedException) as raised:
        run_ranks(2, _fail_on_rank_1)
    assert raised.value.error_index == 1
    assert str(raised.value).split("-- rank ")[1].startswith("1 failed (1 of ")
    assert "ValueError: rank 1 found a bad shard" in str(raised.value).split("-- rank ")[1]


def _rank_1_never_joins(rank: int, world: int) -> None:
    if rank == 0:
        dist.all_reduce(torch.ones(1))
    else:
        time.sleep(3600)


def test_a_hung_collective_fails_after_the_timeout():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="_rank_1_never_joins on 2 ranks ran past 5 s"):
        run_ranks(2, _rank_1_never_joins, timeout=5)
    assert time.monotonic() - start < 30
