"""Preemption on a real 2-rank torchrun job (tiny Llama, DeepSpeed ZeRO-3, gloo), save_every 0 and 400
steps, so nothing is saved unless the stop request saves it (recipes/reliability/preemption.py).

SLURM signals every process of the job step, and torchrun forwards its own SIGTERM to the ranks, so each
rank gets two SIGTERMs milliseconds apart; a second SIGTERM that reached Python's default handler would
kill the rank (-15) before it saved, and its peer with it. Signalling torchrun alone, the one delivery a
SLURM cluster never makes, would not show that. One run directory, five starts, each resuming the last:

1. `<out_dir>/PREEMPT` appears (the SLURM template's trap). Only rank 0 looks for it; rank 1 learns of
   it through the step's all-reduce. Both save the step and exit 75; the file is gone.
2. SLURM's delivery: SIGTERM to rank 0, to torchrun (which forwards its own to every rank) and to rank 1,
   so each rank gets two.
3. Two SIGTERMs to rank 1: saved, both ranks exit 75 (torchrun's summary lists the ranks that had exited
   when it looked: 75 each).
4. Two SIGTERMs to every rank: the same.
5. SIGTERM to both ranks while they start (handlers installed, engine not yet built): both exit 75
   before their first step; nothing new is trained or saved, `latest` is unchanged.
After each: `latest` names the step, the next start resumes from it, and metrics.jsonl holds every step
once. No delivery races the run: each signal is sent once the rank said it had the one before (its
request noted, then each repeat), while the rank is held inside the run by its peer, SIGSTOPped, which
it waits for in the step's collectives (SIGCONT once the rank has said so); so every second SIGTERM lands
on a live rank with its handlers installed, mid-run, and is shown to be the same request.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from tests.recipes.torchrun_helpers import catches, launch, rank_pids, read_metrics, tiny_workspace  # noqa: E402

pytestmark = pytest.mark.timeout(1200)

REPO = Path(__file__).resolve().parents[3]


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
        assert proc.poll() is None, f"the run ended before step {rows}"
        assert time.time() < deadline
        time.sleep(0.05)


def _latest(out) -> int:
    return int((out / "checkpoints" / "latest").read_text().split("_")[1])


def _finish(proc, log: Path) -> str:
    proc.wait(timeout=600)
    return log.read_text()


def _send(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


class Ranks:
    """A running job's ranks, signalled one event at a time: each SIGTERM is followed by a wait for the
    rank's own line saying it got it (the first noted as the request, a later one as its repeat)."""

    def __init__(self, proc, log: Path, pids: dict[int, int]):
        self.proc, self.log, self.pids = proc, log, pids

    def said(self, text: str, timeout: float = 300) -> None:
        deadline = time.time() + timeout
        while text not in self.log.read_text():
            assert self.proc.poll() is None, f"the job ended before {text!r}: {self.log.read_text()[-3000:]}"
            assert time.time() < deadline, f"no {text!r} in {timeout} s: {self.log.read_text()[-3000:]}"
            time.sleep(0.02)

    def term(self, rank: int, first: bool) -> None:
        os.kill(self.pids[rank], signal.SIGTERM)
        self.said(f"rank {rank}: SIGTERM: the run stops" if first else f"rank {rank}: SIGTERM repeated")

    def hold(self, rank: int) -> None:
        """SIGSTOP `rank`: its peer, waiting for it in the step's collectives, cannot leave the run."""
        os.kill(self.pids[rank], signal.SIGSTOP)

    def release(self, rank: int) -> None:
        os.kill(self.pids[rank], signal.SIGCONT)


def _slurm_delivery(r: Ranks) -> None:
    r.hold(1)
    r.term(0, first=True)  # SLURM's own to rank 0
    os.kill(r.proc.pid, signal.SIGTERM)  # SLURM's to torchrun: it forwards SIGTERM to every rank
    r.said("rank 0: SIGTERM repeated")  # torchrun's reached rank 0
    r.hold(0)
    r.release(1)  # rank 1 takes torchrun's SIGTERM, held for it while stopped
    r.said("rank 1: SIGTERM: the run stops")
    r.term(1, first=False)  # SLURM's own to rank 1
    r.release(0)


def _twice_to_rank_1(r: Ranks) -> None:
    r.hold(0)
    r.term(1, first=True)
    r.term(1, first=False)
    r.release(0)


def _twice_to_every_rank(r: Ranks) -> None:
    r.hold(0)
    r.term(1, first=True)
    r.term(1, first=False)
    r.hold(1)
    r.release(0)
    r.term(0, first=True)
    r.term(0, first=False)
    r.release(1)


def test_preemption_saves_once_whatever_the_delivery_and_resumes(recipe, monkeypatch):
    root, path = recipe
    out = root / "run"
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "300")  # as the SLURM templates set it

    # 1. the PREEMPT file, seen by rank 0 only
    proc = launch(path, out)
    _wait_for_rows(proc, out, 3)
    (out / "PREEMPT").touch()
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode != 0 and "exitcode  : 75" in output, output[-3000:]
    saved = _latest(out)
    assert f"preempted ({out / 'PREEMPT'} exists) after step {saved}" in output, output[-3000:]
    assert "preempted (asked on another rank)" in output  # rank 1 learnt it through the all-reduce
    assert 3 <= saved < 400 and not (out / "PREEMPT").exists()
    step_dir = out / "checkpoints" / f"step_{saved:08d}"
    assert (step_dir / "rank_00000.pt").is_file() and (step_dir / "rank_00001.pt").is_file()
    assert [r["step"] for r in read_metrics(out)] == list(range(1, saved + 1))

    deliveries = {  # name: (what it does, whether torchrun is signalled, the signals each rank said it got)
        "SLURM: SIGTERM to rank 0, torchrun (forwarding its own) and rank 1": (_slurm_delivery, True, (2, 2)),
        "two SIGTERMs to rank 1": (_twice_to_rank_1, False, (0, 2)),
        "two SIGTERMs to every rank": (_twice_to_every_rank, False, (2, 2)),
    }
    for n, (delivery, (deliver, to_torchrun, got)) in enumerate(deliveries.items(), start=2):
        log = root / f"start{n}.log"
        proc = launch(path, out, log=log)
        ranks = rank_pids(proc)
        _wait_for_rows(proc, out, saved + 2)
        try:
            deliver(Ranks(proc, log, ranks))
        finally:  # a failed delivery must not leave a rank stopped
            for pid in ranks.values():
                _send(pid, signal.SIGCONT)
        output = _finish(proc, log)
        assert f"resumed tiny from step {saved}" in output, (delivery, output[-3000:])
        previous, saved = saved, _latest(out)
        assert saved >= previous + 2, delivery
        # each rank ends on its `Preempted` (the line `python -m recipes.train` prints before it exits 75)
        for rank, count in enumerate(got):  # each signal noted: the first as the request, the second as its repeat
            assert (output.count(f"rank {rank}: SIGTERM: the run stops"), output.count(f"rank {rank}: SIGTERM repeated")) \
                == ((1, count - 1) if count else (0, 0)), (delivery, output[-4000:])
        said = {"rank 0": "SIGTERM" if got[0] else "asked on another rank", "rank 1": "SIGTERM"}
        assert sorted(re.findall(rf"preempted \((.*?)\) after step {saved}: checkpoint", output)) == sorted(said.values()), (
            delivery, output[-4000:])
        # torchrun's summary, when torchrun was not signalled itself (then it ends on its SignalException):
        # the ranks' statuses it saw (the first to exit; the other, if it had not yet, it then stops)
        statuses = set(re.findall(r"exitcode\s+: (-?\d+)", output))
        assert statuses == (set() if to_torchrun else {"75"}), (delivery, output[-4000:])
        assert "Signal 15 (SIGTERM) received" not in output, delivery
        assert [r["step"] for r in read_metrics(out)] == list(range(1, saved + 1)), delivery  # each step once

    # 5. SIGTERM to both ranks while they start: the handlers are in, the engine not built yet
    log = root / "start5.log"
    proc = launch(path, out, log=log)
    ranks = rank_pids(proc)
    deadline = time.time() + 300
    while not all(catches(pid, signal.SIGTERM, signal.SIGUSR1) for pid in ranks.values()):
        assert proc.poll() is None and time.time() < deadline, "the ranks never installed their handlers"
        time.sleep(0.01)
    for pid in ranks.values():
        os.kill(pid, signal.SIGTERM)
    output = _finish(proc, log)
    assert set(re.findall(r"exitcode\s+: (-?\d+)", output)) == {"75"}, output[-4000:]
    assert output.count(f"preempted (SIGTERM) before step {saved + 1}, while starting: nothing new to save; "
                        f"checkpoint {out / 'checkpoints' / f'step_{saved:08d}'} stays the latest") == 2, output[-3000:]
    assert _latest(out) == saved and [r["step"] for r in read_metrics(out)] == list(range(1, saved + 1))


# ---- the coalescing rule, on this process's own signals ----------------------------------------------

_COALESCE = """
import datetime, os, signal, sys, threading, time
import torch.distributed as dist
from recipes.reliability.preemption import PreemptionWatch

window = float(sys.argv[2])
watch = PreemptionWatch(sys.argv[1], rank=0, window_s=window)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.05)
os.kill(os.getpid(), signal.SIGTERM)  # 50 ms later: the same request
os.kill(os.getpid(), signal.SIGUSR1)  # SIGUSR1 is the same kind of request
deadline = time.monotonic() + 30
while watch.repeats < 2 and time.monotonic() < deadline:
    time.sleep(0.01)
print("alive", watch.requested(), watch.reason, watch.repeats, flush=True)
time.sleep(max(0.0, watch.first_signal_at + window - time.monotonic()) + 0.1)  # past the window
# The late signal arrives while the main thread waits inside C++, as a rank in a collective does
# (Python would run a handler only after the wait): the reader thread acts on it all the same.
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
started = time.monotonic()
try:
    store.wait(["never"], datetime.timedelta(seconds=30))
except Exception as err:
    print("waited", type(err).__name__, flush=True)
print("survived", round(time.monotonic() - started, 1), flush=True)
"""


def test_repeated_signals_inside_the_window_are_one_request_and_one_after_it_stops_at_once(tmp_path):
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _COALESCE, str(tmp_path), "1.5"], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert "alive True SIGTERM 2" in done.stdout, (done.returncode, done.stdout, done.stderr[-2000:])
    assert done.returncode == -signal.SIGKILL, (done.returncode, done.stdout, done.stderr[-2000:])
    assert "survived" not in done.stdout and time.monotonic() - started < 60  # not after the 30 s wait
    assert "rank 0: SIGTERM again" in done.stderr and "stopping now without saving" in done.stderr, done.stderr[-2000:]
    assert done.stderr.count("rank 0: SIGTERM repeated") == 1 and "rank 0: SIGUSR1 repeated" in done.stderr
    assert done.stderr.count("rank 0: SIGTERM: the run stops after the current step") == 1  # one request noted
