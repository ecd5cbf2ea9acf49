"""A rank whose launcher is gone stops at the next step boundary with its step saved (recipes/reliability/
launcher_watch.py). A real 2-rank torchrun job (tiny Llama, DeepSpeed ZeRO-3, save_every 0, 400 steps, the
watchdog on); after 3 logged steps only torchrun's agent is SIGKILLed. Unwatched, its ranks would train on
to the last step, print ~500 C++ stack frames (each failed call to the agent's store) and wait up to 40 s
at exit. Each rank says its launcher is gone (or was asked by the rank that saw it), both save the same
step long before the last and exit on that request (the wait for them has a timeout, not a bound to
pass), no frame is printed, and the same command resumes from that step.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from tests.recipes.torchrun_helpers import _state, launch, rank_pids, read_metrics, tiny_workspace  # noqa: E402

pytestmark = pytest.mark.timeout(900)


def test_ranks_whose_torchrun_agent_is_killed_save_and_exit_within_seconds(tmp_path):
    recipe = tiny_workspace(tmp_path, problems=64, max_digits=2, hidden=32,
                            train={"steps": 400, "max_epochs": 400, "micro_batch_size": 2, "save_every": 0,
                                   "tensorboard": False, "export": False, "watchdog_s": 30})
    out, log = tmp_path / "run", tmp_path / "run.log"
    proc = launch(recipe, out, log=log)
    ranks = rank_pids(proc)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 600
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)  # the agent alone: the ranks live in sessions of their own
    killed = time.monotonic()
    proc.wait(timeout=30)
    try:
        while any(_state(pid) == "alive" for pid in ranks.values()):
            assert time.monotonic() - killed < 120, f"ranks still running: {log.read_text()[-3000:]}"
            time.sleep(0.1)
    finally:  # a rank left running would train on into the run directory
        for pid in ranks.values():
            if _state(pid) == "alive":
                os.kill(pid, signal.SIGKILL)
    print(f"both ranks gone {time.monotonic() - killed:.1f} s after the agent's SIGKILL")  # ~10 s idle
    output = log.read_text()
    latest = (out / "checkpoints" / "latest").read_text()
    saved = int(latest.split("_")[1])
    assert saved >= 3 and saved < 400
    # each rank watches its own parent; the first to see it gone asks the others, which may stop on that
    # request before their own watch looks: at least one rank says it, and every rank stops for one reason
    said = [rank for rank in ranks if f"rank {rank}: its launcher (torchrun's agent, pid {proc.pid}) is gone" in output]
    assert said, output[-3000:]
    reasons = re.findall(rf"preempted \((.*?)\) after step {saved}: checkpoint", output)
    assert len(reasons) == 2 and all("launcher" in r or r == "asked on another rank" for r in reasons), output[-3000:]
    assert "frame #" not in output and "Exception raised from" not in output, output[-3000:]
    assert [r["step"] for r in read_metrics(out)] == list(range(1, saved + 1))

    # the same command resumes from it
    again = launch(recipe, out, f"train.steps={saved + 1}")
    text, _ = again.communicate(timeout=600)
    assert again.returncode == 0 and f"resumed tiny from step {saved}" in text, text[-3000:]
    assert [r["step"] for r in read_metrics(out)] == list(range(1, saved + 2))
