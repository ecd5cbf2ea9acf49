"""One run per train.out_dir (recipes.reliability.run_lock): a second run in a used out_dir is refused naming
the holder; unlocked, both would exit 0, the second resuming from the first's checkpoint, both writing the
same step directories and metrics.jsonl ending with steps twice. A dead holder's lock is removed; one from
another host is refused unless it is this run's own (the same job, requeued)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recipes.reliability.run_lock import LOCK, RunLock, RunLocked

REPO = Path(__file__).resolve().parents[3]
HOLD = ("import sys, time; from recipes.reliability.run_lock import RunLock; "
        "RunLock(sys.argv[1], True).acquire(); print('held', flush=True); time.sleep(120)")


@pytest.fixture
def holder(tmp_path):
    """Another process holding the lock of tmp_path/run."""
    env = {k: v for k, v in os.environ.items() if k not in ("NUMLOSS_RUN_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")}
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "run")], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield proc
    proc.kill()
    proc.wait()


def test_a_second_run_is_refused_naming_the_holder_and_a_dead_holder_is_detected(tmp_path, holder, monkeypatch):
    for key in ("NUMLOSS_RUN_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(RunLocked) as err:
        RunLock(tmp_path / "run", True).acquire()
    assert f"pid {holder.pid} on {socket.gethostname()}" in str(err.value), str(err.value)
    holder.send_signal(signal.SIGKILL)  # the holder dies without releasing: a stale lock
    holder.wait()
    lock = RunLock(tmp_path / "run", True)
    note = lock.acquire()
    assert note.startswith(f"removed a stale lock (pid {holder.pid}"), note
    assert json.loads((tmp_path / "run" / LOCK).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / "run" / LOCK).exists()


def test_a_lock_from_another_host_is_refused_unless_it_is_this_runs_own(tmp_path, monkeypatch):
    (tmp_path / LOCK).write_text(json.dumps({"host": "node-17", "pid": 4242, "started": "2026-01-01T00:00:00",
                                             "run_id": "SLURM_JOB_ID=981"}))
    monkeypatch.setenv("SLURM_JOB_ID", "982")
    monkeypatch.delenv("NUMLOSS_RUN_ID", raising=False)
    with pytest.raises(RunLocked, match=f"pid 4242 on node-17.*cannot be checked from this host; if that run is "
                                        f"gone \\(a lost node\\), remove {tmp_path / LOCK}"):
        RunLock(tmp_path, True).acquire()
    monkeypatch.setenv("SLURM_JOB_ID", "981")  # the same job, requeued onto another node
    assert "took back this run's own lock" in RunLock(tmp_path, True).acquire()


def test_train_refuses_a_used_out_dir_before_building_anything(tmp_path, holder, rec_data_dir, rec_tokenizer_dir):
    demo = REPO / "recipes" / "configs" / "demo.yaml"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    env.pop("NUMLOSS_RUN_ID", None)
    started = time.time()
    proc = subprocess.run([sys.executable, "-m", "recipes.train", str(demo), f"data.train={rec_data_dir}",
                           f"model.tokenizer={rec_tokenizer_dir}", "model.config.vocab_size=512", "train.micro_batch_size=4",
                           "train.global_batch_size=null", "train.steps=2", f"train.out_dir={tmp_path / 'run'}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"is in use by another run (pid {holder.pid} on" in proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [LOCK]  # nothing else written
    assert time.time() - started < 120

