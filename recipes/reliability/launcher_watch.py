"""A rank whose launcher is gone stops at the next step boundary, with its step saved.

torchrun's agent is every rank's parent process and hosts the process group's key-value store. Killed
(SIGKILL: an OOM kill of the launcher, a node agent's cleanup, a user), it can neither forward a stop
signal nor tell the ranks anything: the ranks, whose collectives do not pass through the store, used
to train on to the last step with nobody to report to, every store call failing (the watchdog printed
each failure with its C++ stack: ~500 frames), and wait up to 40 s at exit on the dead store. Here a
thread compares the rank's parent pid with the one it started under, every `period_s`: once it changed
(the rank was re-parented), it asks the run to stop as a SIGTERM would (`PreemptionWatch.ask`), so the
ranks agree at the next step, save it and exit 75; the watchdog stops using the store
(`Watchdog.abandon`). The same command, relaunched, resumes from that step.

Only under torchrun (TORCHELASTIC_RUN_ID set), whose agent starts the ranks itself: a process started
by a shell or a batch script is often meant to outlive its parent (nohup). A Ray Train worker's loop
runs in a thread of a worker process that Ray kills when its controller dies; it is not watched here.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Callable


class LauncherWatch:
    """Watches this process's parent from a daemon thread; `on_gone(reason)` once if it changes."""

    def __init__(self, on_gone: Callable[[str], None], rank: int, period_s: float = 0.5):
        self.on_gone, self.rank, self.period_s = on_gone, rank, period_s
        self.parent = os.getppid()
        self.gone = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="numloss-launcher-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            if os.getppid() != self.parent:
                self.gone = True
                reason = f"its launcher (torchrun's agent, pid {self.parent}) is gone"
                print(f"[numloss] rank {self.rank}: {reason}: the run stops after the current step, saved (exit 75); "
                      f"the same command resumes from it", file=sys.stderr, flush=True)
                self.on_gone(reason)
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.period_s + 1)


def torchrun_agent() -> int | None:
    """The pid of torchrun's agent (this rank's parent, the host of the process group's store) under torchrun;
    None elsewhere (module docstring)."""
    return os.getppid() if os.environ.get("TORCHELASTIC_RUN_ID") else None


def watch_launcher(on_gone: Callable[[str], None], rank: int) -> LauncherWatch | None:
    """This rank's watch of its launcher, under torchrun only (module docstring); None elsewhere."""
    if torchrun_agent() is None:
        return None
    return LauncherWatch(on_gone, rank)
