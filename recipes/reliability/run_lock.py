"""One run per `train.out_dir`: a lock file `<out_dir>/run.lock` taken by rank 0 before anything is
written there, released when the run ends (also on an error or a preemption).

The lock records who holds it: host, pid, the process's start time (so a reused pid is not mistaken for
the holder), when, and the run id (`NUMLOSS_RUN_ID`, set by launch.ray; else SLURM's job id, which a
requeued job keeps; else torchrun's run id). A second run finds the lock and refuses, naming the holder
(`RunLocked`; `python -m recipes.train` exits 2 with nothing written). Exceptions:
- the holder is a dead process on this host (a SIGKILLed run): the lock is stale and taken over, said
  in one line;
- the holder has this run's id: the same run restarted (Ray restarting its workers, a requeued SLURM
  job) takes its own lock back, even from another host;
- the holder is on another host and has another run id: it cannot be checked from here, so the run
  refuses, and the message says which file to remove if that run is known to be gone.

Every rank calls `acquire` (rank 0 decides, the others learn the outcome by one broadcast, so every
rank raises the same error). The lock is created with O_EXCL; two runs taking over the same stale lock
in the same instant is the one race left (both would have to start within milliseconds).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
from pathlib import Path

import torch.distributed as dist

LOCK = "run.lock"


class RunLocked(RuntimeError):
    """Another run holds this out_dir."""


def run_id() -> str | None:
    """This run's id across restarts: NUMLOSS_RUN_ID, else SLURM_JOB_ID, else torchrun's run id."""
    for key in ("NUMLOSS_RUN_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        value = os.environ.get(key)
        if value and value != "none":  # torchrun's default rendezvous id when not --standalone
            return f"{key}={value}"
    return None


def process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22); None if unknown."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def holder_alive(holder: dict) -> bool | None:
    """True/False for a holder on this host; None for one on another host (it cannot be checked)."""
    if holder.get("host") != socket.gethostname():
        return None
    pid = int(holder.get("pid", -1))
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    started = holder.get("process_start")
    return started is None or process_start(pid) == started  # another process under a reused pid: dead


class RunLock:
    def __init__(self, out_dir: str | Path, is_main: bool):
        self.path = Path(out_dir) / LOCK
        self.is_main = is_main
        self.mine: dict | None = None

    def _me(self) -> dict:
        return {"host": socket.gethostname(), "pid": os.getpid(), "process_start": process_start(os.getpid()),
                "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "run_id": run_id()}

    def _write(self, exclusive: bool) -> None:
        data = (json.dumps(self.mine) + "\n").encode()
        if exclusive:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        else:  # a takeover: the new content replaces the old in one rename
            tmp = self.path.with_name(f".{LOCK}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        if not exclusive:
            os.replace(tmp, self.path)

    def _take(self) -> str | None:
        """Rank 0: take the lock; returns a note (a takeover) or None; raises RunLocked."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.mine = self._me()
        try:
            self._write(exclusive=True)
            return None
        except FileExistsError:
            pass
        try:
            holder = json.loads(self.path.read_text())
        except (OSError, ValueError):
            holder = {}
        who = (f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"
               + (f", {holder['run_id']}" if holder.get("run_id") else ""))
        if self.mine["run_id"] is not None and holder.get("run_id") == self.mine["run_id"]:
            self._write(exclusive=False)
            return f"took back this run's own lock ({who}): a restart of the same run"
        alive = holder_alive(holder) if holder else False
        if alive is False:
            self._write(exclusive=False)
            return f"removed a stale lock ({who or 'unreadable'}: that process is gone)"
        self.mine = None
        where = "" if alive else (" It cannot be checked from this host; if that run is gone (a lost node), "
                                  f"remove {self.path} and start again.")
        raise RunLocked(f"{self.path.parent} is in use by another run ({who}): two runs in one train.out_dir "
                        f"would write the same checkpoints and metrics. Wait for it to end or use another "
                        f"train.out_dir.{where}")

    def acquire(self) -> str | None:
        """Every rank: rank 0 takes the lock; all raise RunLocked if it is held. Returns rank 0's note."""
        outcome: list = [None]
        if self.is_main:
            try:
                outcome = [("ok", self._take())]
            except RunLocked as err:
                outcome = [("locked", str(err))]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(outcome, src=0)
        kind, text = outcome[0]
        if kind == "locked":
            raise RunLocked(text)
        return text

    def release(self) -> None:
        """Rank 0: remove the lock if it is still ours (never another run's)."""
        if not (self.is_main and self.mine):
            return
        try:
            if json.loads(self.path.read_text()) == self.mine:
                self.path.unlink()
        except (OSError, ValueError):
            pass
        self.mine = None
