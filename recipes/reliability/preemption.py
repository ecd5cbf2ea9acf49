"""Preemption: a run asked to stop finishes its current step, saves a checkpoint and exits with its own
status, so the next start resumes where it stopped instead of from the last `save_every`.

Asking: SIGTERM (what SLURM, Kubernetes and torchrun send before killing) or SIGUSR1 (what `sbatch
--signal` can send ahead of the time limit) to any rank; or the file `<out_dir>/PREEMPT` (what the SLURM
templates' trap writes, as the batch shell is the one process that receives `--signal=B:USR1`; rank 0
looks for it once a step).

One preemption, several signals: SLURM signals every process of the job step and torchrun forwards its
own SIGTERM to its ranks, so a rank gets two SIGTERMs a few milliseconds apart; Kubernetes, `scancel`
and a user's `kill` may repeat too. Every SIGTERM or SIGUSR1 within `train.preempt_window_s` of the first
is the same request (the two are one kind of request: save and stop). Only a signal after the window,
when the save has had its grace time and is evidently stuck, stops the rank at once, and says so on
stderr. The PREEMPT file is a request too, but never stops anything at once, and does not start the
window: the time-limit SIGTERM that SLURM sends `preempt_notice_s` after the notice must not kill a
save still going on.

The signals are read by a thread, not by a Python handler: Python runs a handler only when the main
thread is back in the interpreter, and a rank waiting inside a collective (the save's barrier, an
all-reduce with a frozen peer) does not come back until the collective returns, up to
`train.dist_timeout_minutes` later. The handler installed for SIGTERM and SIGUSR1 does nothing (it
only replaces the default action, which kills); Python's C-level handler writes each signal's number
to a pipe (`signal.set_wakeup_fd`) at once, whatever the main thread is doing, and the thread applies
the rule above. The stop at once is a SIGKILL of the rank itself: the default action of the signal
cannot be restored from a thread.

The ranks agree on a request through the same MAX all-reduce as the non-finite check
(`recipes.reliability.health.any_rank`), at four points, so all of them stop at the same place and save
together: before the first step (a request during the start, the engine build or the checkpoint load:
nothing was trained, nothing is saved, the checkpoint it started from stays `latest`), after every step
(the step is saved), right after a periodic save (the step just saved is the one kept: no second save),
and before the export (the last step is saved, the export is left to the next start, which runs no step
and exports). A request during the export lets it finish (the run then ends as it would have, 0); one
after it changes nothing: the handlers stay until the teardown is over, and `python -m recipes.train`
then ignores these signals while it exits (`ignore_stop_signals`). `recipes.train` raises `Preempted` (the Ray launcher's workers fail with it,
so Ray restarts the group from that checkpoint when `--max-failures` allows) and `python -m
recipes.train` exits 75 (EX_TEMPFAIL: try again).

Handlers can only be installed from the main thread (not in a Ray Train worker, whose loop runs in a
thread): there the file, and Ray's own restarts, remain.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from .health import any_rank

PREEMPT_FILE = "PREEMPT"
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_STOP_READER = 0  # written to the pipe by `close`: no signal has number 0


class Preempted(RuntimeError):
    """The run was asked to stop; `checkpoint` (saved at `step`, None: no checkpoint yet) resumes it.

    `stage`: "step" (the step was saved on the request), "start" (asked before the first step of this
    start: nothing new was trained), "export" (asked after the last step: saved, the export not started)."""

    def __init__(self, step: int, checkpoint: Path | None, reason: str, stage: str = "step"):
        self.step, self.checkpoint, self.reason, self.stage = step, checkpoint, reason, stage
        if stage == "start":
            kept = (f"checkpoint {checkpoint} stays the latest; the same command resumes from it" if checkpoint
                    else "no checkpoint yet; the same command starts the run")
            text = f"preempted ({reason}) before step {step + 1}, while starting: nothing new to save; {kept}"
        elif stage == "export":
            text = (f"preempted ({reason}) after the last step, {step}: checkpoint {checkpoint} saved, the export "
                    f"not started; the same command exports it")
        else:
            text = f"preempted ({reason}) after step {step}: checkpoint {checkpoint} saved; the same command resumes from it"
        super().__init__(text)


def _ignore(signum, frame) -> None:
    """The Python-level handler: nothing (the reader thread acts); its presence replaces the default
    action, which would kill the rank before it saves."""


def ignore_stop_signals() -> None:
    """For a process whose run has ended (`python -m recipes.train`, on its way out with its status):
    torchrun stops the ranks still running once one has exited, and that SIGTERM, the same preemption's,
    would turn a saved rank's 75 into -15 while the interpreter shuts down (seen in 1 of 3 tries)."""
    if threading.current_thread() is threading.main_thread():
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


class PreemptionWatch:
    """Collects this rank's stop requests; `requested()` is read by the loop at its agreement points.

    `window_s` is `train.preempt_window_s`: repeats of a signal inside it are the same request."""

    def __init__(self, out_dir: str | Path, rank: int, window_s: float):
        self.file = Path(out_dir) / PREEMPT_FILE
        self.rank, self.is_main, self.window_s = rank, rank == 0, window_s
        self.reason: str | None = None
        self.first_signal_at: float | None = None  # time.monotonic() of the first signal
        self.repeats = 0  # signals inside the window after the first
        self._from_file = False
        self._previous: dict = {}
        self._previous_wakeup: int | None = None
        self._pipe: tuple[int, int] | None = None
        self._reader: threading.Thread | None = None
        if threading.current_thread() is threading.main_thread():
            self._install()

    def _install(self) -> None:
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)  # set_wakeup_fd's requirement: a signal never blocks on it
        self._pipe = (read_end, write_end)
        # the wakeup fd first: from the moment a handler is installed, every signal reaches the pipe
        self._previous_wakeup = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, _ignore)
        self._reader = threading.Thread(target=self._read, name="numloss-preemption", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        read_end = self._pipe[0]
        while True:
            data = os.read(read_end, 64)
            now = time.monotonic()
            for signum in data:
                if signum == _STOP_READER:
                    return
                if signum in SIGNALS:  # the pipe also carries any other signal with a Python handler (SIGINT)
                    self.on_signal(signal.Signals(signum), now)
            if not data:  # every write end closed
                return

    def on_signal(self, sig: signal.Signals, now: float) -> None:
        """The coalescing rule, for a signal that arrived at `now` (time.monotonic())."""
        if self.first_signal_at is None:
            self.first_signal_at = now
            self.reason = self.reason or sig.name
            print(f"[numloss] rank {self.rank}: {sig.name}: the run stops after the current step, saved (exit 75); "
                  f"SIGTERM/SIGUSR1 within train.preempt_window_s ({self.window_s:g} s) are this same request",
                  file=sys.stderr, flush=True)
            return
        after = now - self.first_signal_at
        if after < self.window_s:
            self.repeats += 1
            print(f"[numloss] rank {self.rank}: {sig.name} repeated {after:.1f} s after the first request, within "
                  f"train.preempt_window_s: the same request", file=sys.stderr, flush=True)
            return
        print(f"[numloss] rank {self.rank}: {sig.name} again, {after:.0f} s after the first request "
              f"(train.preempt_window_s {self.window_s:g}): the save has not finished in that time; stopping now "
              f"without saving (checkpoints/latest names the last complete checkpoint)", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def ask(self, reason: str) -> None:
        """A stop request from this process itself (`recipes.reliability.launcher_watch`: the launcher is
        gone): the same outcome as a signal, but, like the file, it starts no window."""
        self.reason = self.reason or reason

    def clear_stale_file(self) -> None:
        """Rank 0 at start, holding the run lock: a PREEMPT file left by an earlier allocation is not for this run."""
        if self.is_main and self.file.exists():
            self.file.unlink(missing_ok=True)

    def requested(self) -> bool:
        """This rank was asked to stop (a signal, or on rank 0 the file)."""
        if self.reason is None and self.is_main and self.file.exists():
            self.reason, self._from_file = f"{self.file} exists", True
        return self.reason is not None

    def agreed(self, device: torch.device) -> bool:
        """Whether any rank was asked to stop: one MAX all-reduce, so every rank calls it at the same point."""
        return any_rank([self.requested()], device)[0]

    @property
    def cause(self) -> str:
        """What this rank was asked by, for `Preempted` (another rank's request arrives as the all-reduce's)."""
        return self.reason or "asked on another rank"

    def close(self) -> None:
        """Restore the previous handlers and wakeup fd, end the reader; rank 0 removes the file it acted on."""
        if self._pipe is not None:
            for sig, previous in self._previous.items():  # first: a signal from here takes its old course
                signal.signal(sig, previous)
            self._previous = {}
            signal.set_wakeup_fd(self._previous_wakeup if self._previous_wakeup is not None else -1)
            read_end, write_end = self._pipe
            os.write(write_end, bytes([_STOP_READER]))  # a forked child may hold the write end: no EOF to wait for
            self._reader.join(timeout=5)
            os.close(write_end)
            os.close(read_end)
            self._pipe = None
        if self.is_main and self._from_file:
            self.file.unlink(missing_ok=True)
