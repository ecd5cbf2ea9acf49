"""Preemption: a run asked to stop finishes its current step, saves a checkpoint and exits with its own
status, so the next start resumes where it stopped instead of from the last `save_every`.

Asking: SIGTERM (what SLURM, Kubernetes and torchrun send before killing: torchrun passes its own on to
the ranks) or SIGUSR1 (what `sbatch --signal` can send ahead of the time limit) to any rank; or the
file `<out_dir>/PREEMPT` (what the SLURM templates' trap writes, as the batch shell is the one process
that receives `--signal=B:USR1`; rank 0 looks for it once a step). A second signal of the same kind
ends the process at once (the default action).

The ranks agree at the end of every step through the same MAX all-reduce as the non-finite check
(`recipes.training.health.any_rank`), so all of them stop after the same step, save together and exit;
`recipes.train` raises `Preempted` (the Ray launcher's workers fail with it, so Ray restarts the group
from that checkpoint when `--max-failures` allows) and `python -m recipes.train` exits 75
(EX_TEMPFAIL: try again). A signal that arrives after the last step changes nothing: the run ends as
it would have.

Handlers can only be installed from the main thread (not in a Ray Train worker, whose loop runs in a
thread): there the file, and Ray's own restarts, remain.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

PREEMPT_FILE = "PREEMPT"
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(RuntimeError):
    """The run was asked to stop; it saved a checkpoint at `step` and can be resumed."""

    def __init__(self, step: int, checkpoint: Path | None, reason: str):
        self.step, self.checkpoint, self.reason = step, checkpoint, reason
        super().__init__(f"preempted ({reason}) after step {step}: checkpoint {checkpoint} saved; the same command "
                         f"resumes from it")


class PreemptionWatch:
    def __init__(self, out_dir: str | Path, is_main: bool):
        self.file = Path(out_dir) / PREEMPT_FILE
        self.is_main = is_main
        self.reason: str | None = None
        self._previous: dict = {}
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.reason == name:  # asked twice: stop now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.reason = self.reason or name

    def clear_stale_file(self) -> None:
        """Rank 0 at start: a PREEMPT file left by an earlier allocation is not for this run."""
        if self.is_main and self.file.exists():
            self.file.unlink(missing_ok=True)

    def requested(self) -> bool:
        """This rank was asked to stop (a signal, or on rank 0 the file)."""
        if self.reason is None and self.is_main and self.file.exists():
            self.reason = f"{self.file} exists"
        return self.reason is not None

    def close(self) -> None:
        """Restore the previous handlers; rank 0 removes the file it acted on."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}
        if self.is_main and self.reason is not None:
            self.file.unlink(missing_ok=True)
