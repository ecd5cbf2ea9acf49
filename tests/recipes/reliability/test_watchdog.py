"""The watchdog (recipes/reliability/watchdog.py): without it a frozen rank holds the job for
`train.dist_timeout_minutes` (60 min) and nobody names it.

- The rule (`find_stall`), by hand: silent ranks, stuck ranks that others wait for, and what is never
  judged (the start, a save, ranks all in one place, ranks that left).
- 2 gloo ranks with the real watchdog thread: rank 1 stays alive but makes no progress (a data read that
  never returns) while rank 0 waits in an all-reduce; rank 0 names rank 1 and the ranks exit 4. Rank 1 ends
  early (exit 0, saying how; or gone without a word) while rank 0 enters a collective: rank 0 names it
  (rank, host, pid, step) and exits 4, where it died on gloo's "Connection closed by peer".
- A real 2-rank torchrun job (tiny Llama, DeepSpeed ZeRO-3, save_every 2, train.watchdog_s 5): rank 0
  is SIGSTOPped mid-training (the monitor itself, watched by rank 1). The job ends by the watchdog's
  hand (rank 1 names rank 0 and its pid, SIGKILLs it and exits 4), not the collective timeout of 60 min,
  which lies past the test's wait; `latest` names a checkpoint whose every file still matches its checksum.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing import ProcessExitedException

from recipes.reliability.watchdog import Beat, Seen, Stall, find_stall
from tests.distributed import run_ranks
from tests.recipes.torchrun_helpers import read_metrics

pytestmark = pytest.mark.timeout(900)


def _seen(step: int, phase: str, silent: float, still: float, now: float = 1000.0, closed: bool = False) -> Seen:
    """A rank last heard `silent` s ago, in `phase` of `step` for `still` s."""
    beat = Beat(rank=-1, host="h", pid=1, process_start=None, step=step, phase=phase, moves=1, beat=1, closed=closed)
    return Seen(beat, heard_at=now - silent, moved_at=now - still)


def test_the_rule_names_silent_and_stuck_ranks_and_leaves_long_phases_alone():
    w = 5.0
    # silent: no heartbeat for 6 s, whatever its phase (here a save); the longest silent is named
    stall = find_stall({0: _seen(7, "collective", 0.5, 6), 1: _seen(6, "save", 6, 6), 2: _seen(7, "data", 9, 9)},
                       1000.0, w)
    assert (stall.rank, stall.kind, stall.seconds, stall.waiting) == (2, "silent", 9.0, (0, 1))
    # never heard from since the monitor started
    assert find_stall({0: _seen(3, "data", 0, 0), 1: Seen(None, 990.0, 990.0)}, 1000.0, w).rank == 1
    # stuck: alive, no move for 6 s in data of step 7 while rank 0 waits in train_step of step 7
    stall = find_stall({0: _seen(7, "train_step", 0.5, 6), 1: _seen(7, "data", 0.5, 6)}, 1000.0, w)
    assert (stall.rank, stall.kind, stall.seconds, stall.waiting) == (1, "stuck", 6.0, (0,))
    # the furthest behind of several stuck ranks: rank 3 still logs step 6
    stall = find_stall({0: _seen(7, "train_step", 0, 8), 1: _seen(7, "train_step", 0, 8), 2: _seen(7, "data", 0, 8),
                        3: _seen(6, "log", 0, 8)}, 1000.0, w)
    assert (stall.rank, stall.waiting) == (3, (0, 1, 2))
    # below the limit: nothing
    assert find_stall({0: _seen(7, "train_step", 4.9, 4.9), 1: _seen(7, "data", 4.9, 4.9)}, 1000.0, w) is None
    # every rank in the same place for long (a slow step, or a kernel frozen on every rank): nobody to name
    assert find_stall({0: _seen(7, "train_step", 0, 600), 1: _seen(7, "train_step", 0, 600)}, 1000.0, w) is None
    # long phases are never stuck: a long start (HF load, conversion) or save while another rank waits
    assert find_stall({0: _seen(1, "data", 0, 600), 1: _seen(0, "start", 0.5, 600)}, 1000.0, w) is None
    assert find_stall({0: _seen(5, "data", 0, 600), 1: _seen(4, "save", 0.5, 600)}, 1000.0, w) is None
    assert find_stall({0: _seen(9, "export", 0, 600), 1: _seen(9, "export", 0.5, 600)}, 1000.0, w) is None
    # the held-out evaluation (eval.every) is a phase of the step: a rank stuck in it while another is on the
    # next step is named, and a rank still evaluating step 6 is behind one that logs it (eval comes first)
    stall = find_stall({0: _seen(8, "data", 0, 6), 1: _seen(7, "eval", 0.5, 6)}, 1000.0, w)
    assert (stall.rank, stall.kind, stall.waiting) == (1, "stuck", (0,))
    assert find_stall({0: _seen(6, "eval", 0, 6), 1: _seen(6, "log", 0, 6)}, 1000.0, w).rank == 0
    # a rank that left training (done, failed, preempted) is not watched
    assert find_stall({0: _seen(7, "log", 0, 0), 1: _seen(7, "log", 60, 60, closed=True)}, 1000.0, w) is None
    # ... unless it left early on its own while others train: named at once, the first to leave first
    left = Seen(Beat(2, "h", 1, None, 3, "log", 1, 1, True, "it exited with status 0 (SystemExit)"), 999.0, 999.0)
    later = Seen(Beat(1, "h", 1, None, 4, "data", 1, 1, True, "DataError: bad row"), 999.5, 999.5)
    stall = find_stall({0: _seen(4, "collective", 0, 0), 1: later, 2: left}, 1000.0, w)
    assert (stall.rank, stall.kind, stall.waiting) == (2, "left", (0,))
    assert find_stall({0: _seen(4, "collective", 0, 0, closed=True), 2: left}, 1000.0, w) is None  # nobody left
    # a process gone without its closing beat (seen on its host); after a failed collective, 2 periods of
    # silence are enough (`silent_s`), not train.watchdog_s
    gone = _seen(3, "log", 0.5, 0.5)
    gone.gone = True
    assert find_stall({0: _seen(4, "collective", 0, 0), 1: gone}, 1000.0, w).kind == "gone"
    assert find_stall({0: _seen(4, "collective", 0, 0), 1: _seen(3, "log", 2.5, 2.5)}, 1000.0, w) is None
    assert find_stall({0: _seen(4, "collective", 0, 0), 1: _seen(3, "log", 2.5, 2.5)}, 1000.0, w, silent_s=2).kind \
        == "silent"


def test_a_verdict_travels_through_the_store_as_json_and_reads_as_a_line():
    beat = Beat(1, "node7", 4242, "123", 7, "data", 30, 99)
    stall = Stall.from_json(Stall(1, "stuck", 612.4, beat, (0, 2)).to_json())
    assert stall == Stall(1, "stuck", 612.4, beat, (0, 2))
    assert stall.line(600, "step_00000006", 4) == (
        "[numloss] watchdog: rank 1 (host node7, pid 4242) has made no progress for 612.4 s (train.watchdog_s 600) "
        "in data of step 7, while ranks 0, 2 further on wait for it. Ending the job (exit 4) instead of waiting "
        "train.dist_timeout_minutes; checkpoints/latest names step_00000006, complete before this; the same command "
        "resumes from it")


def test_once_torchruns_agent_is_gone_the_watchdog_never_calls_its_store(monkeypatch, tmp_path):
    """The agent hosts the store: after it is gone every store call fails and torch logs each failure with its
    C++ stack. A watchdog whose recorded agent is no longer its parent stops before its first call."""
    import recipes.reliability.watchdog as W

    class Store:
        calls: list = []

        def __getattr__(self, name):
            return lambda *args, **kwargs: Store.calls.append(name)

    monkeypatch.setattr(W, "torchrun_agent", lambda: os.getppid() + 1_000_000)  # not this process's parent
    dog = W.Watchdog(30.0, 0, 2, Store(), tmp_path, 4)
    dog._thread.join(timeout=30)
    assert not dog._thread.is_alive() and dog._abandoned and Store.calls == []
    dog.close()
    monkeypatch.setattr(W, "torchrun_agent", lambda: None)  # not under torchrun: the store is used
    dog = W.Watchdog(30.0, 0, 2, Store(), tmp_path, 4)
    deadline = time.monotonic() + 30
    while not Store.calls and time.monotonic() < deadline:
        time.sleep(0.01)
    dog.abandon()
    dog.close()
    assert "set" in Store.calls


@pytest.mark.parametrize("override", ["train.watchdog_s=-1", "train.watchdog_s=nan", "train.watchdog_s=.inf",
                                      "train.preempt_window_s=0", "train.preempt_window_s=-5"])
def test_the_settings_are_checked_and_named(override):
    from recipes.config import recipe_from_dict

    base = {"model": {"config": {"model_type": "llama"}, "tokenizer": "t"}, "data": {"train": "d"}}
    with pytest.raises(ValueError, match=override.split("=")[0].replace(".", r"\.") + ": "):  # the key, first
        recipe_from_dict(base, [override])
    recipe = recipe_from_dict(base, ["train.watchdog_s=0"])  # 0: off
    assert (recipe.train.watchdog_s, recipe.train.preempt_window_s) == (0, 600)


def _stuck_in_data(rank: int, world: int, out: str) -> None:
    from recipes.reliability.watchdog import mark_phase, start_watchdog

    Path(out, f"pid_{rank}").write_text(str(os.getpid()))
    start_watchdog(2.0, rank, world, Path(out) / "checkpoints", 4)
    for step in (1, 2):  # two steps in step
        for phase in ("data", "train_step", "collective", "log"):
            mark_phase(phase, step)
            if phase == "collective":
                dist.all_reduce(torch.ones(1))
    mark_phase("data", 3)
    if rank == 1:
        threading.Event().wait()  # alive, heartbeat moving, but no progress: a data read that never returns
    else:
        mark_phase("train_step", 3)
        dist.all_reduce(torch.ones(1))  # waits for rank 1, as a ZeRO-3 gather in the forward would
    raise AssertionError(f"rank {rank} went on: the watchdog did not end it")


def _one_leaves_early(rank: int, world: int, out: str, how: str) -> None:
    """Two steps together, then rank 1 ends at step 3 (`how`: "exit", leaving as recipes.train's rank does on
    a SystemExit; "gone", os._exit without a word) while rank 0 goes on into a collective (gloo: a socket
    error naming no rank); rank 0 asks its watchdog (`peer_lost`, as recipes.train does)."""
    from recipes.reliability.watchdog import mark_phase, start_watchdog

    Path(out, f"pid_{rank}").write_text(str(os.getpid()))
    # the default train.watchdog_s, whose period is 10 s: the failed collective wakes the watchdog at once
    watchdog = start_watchdog(600.0, rank, world, Path(out) / "checkpoints", 4)
    for step in (1, 2, 3):
        for phase in ("data", "train_step", "collective", "log"):
            mark_phase(phase, step)
            if phase == "collective" and step < 3:
                dist.all_reduce(torch.ones(1))
    if rank == 1:
        if how == "exit":
            watchdog.close(early="it exited with status 0 (SystemExit)")
        os._exit(0)
    mark_phase("collective", 3)
    try:
        dist.all_reduce(torch.ones(1))
    except RuntimeError:
        watchdog.peer_lost()
        raise
    raise AssertionError("rank 0's collective went through without rank 1")


@pytest.mark.parametrize("how, said", [("exit", "left the run early, at step 3 in log (it exited with status 0 "
                                                "(SystemExit)), while rank 0 trains on"),
                                       # the step it last published: a heartbeat ago (10 s), here its start
                                       ("gone", "is gone: its process ended at step 0 in start (its last heartbeat) without leaving the "
                                                "run (killed, or os._exit), while rank 0 trains on")])
def test_a_rank_that_ends_early_is_named_by_the_others(tmp_path, capfd, how, said):
    with pytest.raises(ProcessExitedException) as failed:
        run_ranks(2, _one_leaves_early, str(tmp_path), how, timeout=90)
    err = capfd.readouterr().err
    assert failed.value.exit_code == 4 and failed.value.error_index == 0, err[-3000:]
    pid = int((tmp_path / "pid_1").read_text())
    assert f"[numloss] watchdog: rank 1 (host {socket.gethostname()}, pid {pid}) {said}" in err, err[-3000:]
    assert "no checkpoint was saved yet" in err and err.count("[numloss] watchdog: ") == 1


def test_a_rank_stuck_while_another_waits_is_named_and_every_rank_exits(tmp_path, capfd):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_00000002")
    with pytest.raises(ProcessExitedException) as failed:  # rank 1 never returns: only the watchdog ends it
        run_ranks(2, _stuck_in_data, str(tmp_path), timeout=300)
    err = capfd.readouterr().err
    assert failed.value.exit_code == 4, err[-3000:]
    pid = int((tmp_path / "pid_1").read_text())
    assert (f"[numloss] watchdog: rank 1 (host {socket.gethostname()}, pid {pid}) has made no progress for "
            in err), err[-3000:]
    assert "in data of step 3, while rank 0 further on waits for it" in err
    assert "checkpoints/latest names step_00000002" in err
    assert err.count("[numloss] watchdog: ") == 1  # one verdict, one line


# ---- a frozen rank in a real torchrun job --------------------------------------------------------------


def _intact(step_dir: Path) -> None:
    """Every file of the checkpoint's manifest has its recorded size and sha256 (computed here)."""
    files = json.loads((step_dir / "checkpoint.json").read_text())["files"]
    assert files
    for name, want in files.items():
        data = (step_dir / name).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (want["bytes"], want["sha256"]), name


def test_a_stopped_rank_under_torchrun_is_named_and_the_job_ends_long_before_the_timeout(tmp_path):
    pytest.importorskip("deepspeed")
    from tests.recipes.torchrun_helpers import _descendants, launch, rank_pids, tiny_workspace

    path = tiny_workspace(tmp_path, problems=64, max_digits=2, hidden=32,
                          train={"steps": 400, "max_epochs": 400, "micro_batch_size": 2, "grad_accum": 1,
                                 "save_every": 2, "tensorboard": False, "export": False, "watchdog_s": 5})
    out, log = tmp_path / "run", tmp_path / "run.log"
    proc = launch(path, out, log=log)
    job = []
    try:
        ranks = rank_pids(proc)
        job = [proc.pid, *_descendants(proc.pid)]
        deadline = time.time() + 600
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 5):  # a checkpoint at step 4
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        os.kill(ranks[0], signal.SIGSTOP)  # rank 0: frozen mid-training, the main monitor with it
        stopped = time.monotonic()
        proc.wait(timeout=300)
        took = time.monotonic() - stopped
        output = log.read_text()
    finally:
        for pid in job:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode != 0, output[-3000:]
    assert f"watchdog: rank 0 (host {socket.gethostname()}, pid {ranks[0]}) has stopped answering: no heartbeat" \
        in output, output[-3000:]
    assert f"rank 1: sent SIGKILL to rank 0 (pid {ranks[0]})" in output  # torchrun need not wait for it
    assert "exitcode  : 4" in output, output[-3000:]  # rank 1's status in torchrun's summary
    print(f"the job ended {took:.1f} s after rank 0 stopped")  # the collective timeout (60 min) is past the wait's
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert int(latest.split("_")[1]) >= 4
    _intact(out / "checkpoints" / latest)


def test_a_rank_that_exits_0_early_under_torchrun_is_named_by_the_others(tmp_path):
    """`recipes.train` on 2 torchrun ranks (DeepSpeed ZeRO-3, the default train.watchdog_s, 600 s): rank 1
    raises SystemExit(0) once step 3 is logged (tests/recipes/faults' exit_early). Rank 0, whose next
    collective fails on gloo's closed socket, names rank 1, its pid and how it ended, and exits 4 within
    seconds (the default period is 10 s: the failed collective wakes the watchdog), not 1 on a bare socket
    error naming no rank."""
    pytest.importorskip("deepspeed")
    from tests.recipes.test_train_final import FAULTS
    from tests.recipes.torchrun_helpers import launch, rank_pids, tiny_workspace

    path = tiny_workspace(tmp_path, problems=64, max_digits=2, hidden=32,
                          train={"steps": 40, "max_epochs": 40, "micro_batch_size": 2, "save_every": 0,
                                 "tensorboard": False, "export": False})
    proc = launch(path, tmp_path / "run", site=FAULTS, env={"NUMLOSS_TEST_FAULT": "1:exit_early:3"})
    ranks = rank_pids(proc)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode != 0 and "exitcode  : 4" in output, output[-4000:]
    assert (f"[numloss] watchdog: rank 1 (host {socket.gethostname()}, pid {ranks[1]}) left the run early, at step "
            in output), output[-4000:]
    assert "(it exited with status 0 (SystemExit)), while rank 0 trains on" in output, output[-4000:]
    assert "Connection closed by peer" not in output and "[rank0]: Traceback" not in output, output[-4000:]
    assert len(read_metrics(tmp_path / "run")) < 40  # rank 0 did not train on alone
