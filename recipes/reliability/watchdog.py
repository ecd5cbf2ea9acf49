"""Watchdog: a rank that stops answering is named, and the job ends long before `train.dist_timeout_minutes`.

A frozen rank (a stopped or swapped-out process, a hung node, a rank stuck in one place) leaves the
others waiting inside a collective until its timeout, 60 minutes by default, whose error names the
collective, not the rank. Here each rank publishes where it is from a daemon thread, through a
connection of its own to the process group's key-value store (`recipes.training.runtime.side_store`:
the collectives never pass through it, so a blocked collective does not block it): its rank, host,
pid, the step and the phase it is in, a counter that moves at every phase change, and a heartbeat
counter that moves every period (watchdog_s / 5, between 0.2 and 10 s). The loop marks the phases
(`mark_phase`). Monitors read them and judge on their own clock (no clock is compared across hosts):

- silent: a rank whose heartbeat has not moved for `train.watchdog_s`. Its process does not run at all
  (stopped, frozen in the kernel, its host or its link to the store gone), whatever the phase.
- stuck: a rank whose phase has not moved for `train.watchdog_s`, in a phase of a step's rhythm (data,
  train_step: forward, backward and optimizer; collective: the step's reductions; log), while another
  rank is further on (a later step, or a later phase of the same step) and so waits for it. Ranks all in
  the same place are not judged: a slow step looks the same on every rank (the collective timeout
  stays the bound there).

- left: a rank that left the run before it finished, on its own (`Watchdog.close(early=...)`: it returned
  or exited, `sys.exit(0)` included, or raised what the others did not: bad data on its rank), while
  others still train: they would fail in their next collective with a bare socket error naming no rank
  (gloo) or wait in it for the collective timeout (NCCL).
- gone: a rank whose process ended without leaving (killed, `os._exit`), seen at once on its own host
  (its pid and start time), elsewhere as a heartbeat that stops: after a collective of this rank failed
  (`Watchdog.peer_lost`), two periods without one are enough.

The long phases are never called stuck: `start` (the distributed set-up, the checks, the engine build
with its Hugging Face load or Megatron conversion, the checkpoint load), `save` and `export` take as long
as storage and model size make them, their collectives are bounded by `dist_timeout_minutes`, and a rank
in them still answers (its heartbeat moves), so only a silent rank is named there.

Monitors: rank 0 watches every rank; rank 1 watches rank 0 (the watcher is watched). The first verdict
is written to the store (compare-and-set: one verdict per run attempt), and every rank that still runs
acts on it within a period: the monitor that wrote it prints one line naming the stalled rank (rank,
host, pid, its last step and phase, how long it has been silent or stuck, which ranks wait); a rank on
the same host as a silent one sends it SIGKILL (checked by pid and process start time; torchrun would
otherwise wait TORCH_ELASTIC_SHUTDOWN_TIMEOUT for a stopped process that cannot take its SIGTERM); the
exit callback runs (the run lock); and the process ends at once with `exit_status` (`python -m
recipes.train`: 4), from this thread, as the main thread is blocked in a collective. torchrun then
reports each rank's status and exits 1; Ray restarts the group from the last checkpoint (a failed
attempt); a SLURM job ends with torchrun's status. `latest` only ever names a complete checkpoint
(`recipes.reliability.checkpoints`), so the last checkpoint stays intact even when a rank froze mid-save.

Off when `train.watchdog_s` is 0 or the world is one process. The store is the one the process group was
made with: under torchrun the agent's, which a frozen rank cannot freeze. Where a rank hosts it (Ray
Train, a plain env:// launch: rank 0), a frozen rank 0 freezes the store too; a store call then waits
past its own timeout (seen with torch 2.13), and the watchdog says nothing: the collective timeout
stays the bound there.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from .launcher_watch import torchrun_agent
from .run_lock import process_start
from recipes.training.runtime import side_store

# The phases in the order a rank passes them within one step (a later phase of the same step is further on).
# `eval`: the held-out rows every eval.every steps (a collective forward on every rank, like a step's).
PHASES = ("start", "data", "train_step", "collective", "eval", "log", "save", "export")
STEP_PHASES = frozenset({"data", "train_step", "collective", "eval", "log"})  # the step's rhythm: judged as stuck
KEY = "numloss/watchdog"
STORE_TIMEOUT_S = 30.0  # one store call on the side connection (a live store answers in milliseconds)

_active: Watchdog | None = None


def mark_phase(phase: str, step: int) -> None:
    """Tell this process's watchdog that the rank is now in `phase` of `step` (the step being trained;
    cheap: a few assignments). Nothing when no watchdog runs."""
    if _active is not None:
        _active.phase(phase, step)


@dataclass(frozen=True)
class Beat:
    """What a rank publishes, every period."""

    rank: int
    host: str
    pid: int
    process_start: str | None
    step: int
    phase: str
    moves: int  # phase changes so far
    beat: int  # heartbeats so far
    closed: bool = False  # the rank has left training (done, failed or preempted): not watched any more
    early: str = ""  # closed before the run finished, on its own (how, in words); "": finished, or stopped with all

    def position(self) -> tuple[int, int]:
        return self.step, PHASES.index(self.phase)


@dataclass
class Seen:
    """What a monitor knows of one rank, on the monitor's clock (time.monotonic())."""

    beat: Beat | None
    heard_at: float  # when its heartbeat last moved (or when the monitor started)
    moved_at: float  # when its phase last moved
    gone: bool = False  # its process, on this monitor's host, has ended without closing its beat

    def update(self, beat: Beat, now: float) -> None:
        if self.beat is None or beat.beat != self.beat.beat:
            self.heard_at = now
        if self.beat is None or beat.moves != self.beat.moves:
            self.moved_at = now
        self.beat = beat


@dataclass(frozen=True)
class Stall:
    """A verdict: `rank` has been `kind` ("silent" or "stuck") for `seconds`; `waiting` are the others."""

    rank: int
    kind: str
    seconds: float
    beat: Beat | None
    waiting: tuple[int, ...]

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "waiting": list(self.waiting)})

    @classmethod
    def from_json(cls, text: str | bytes) -> Stall:
        data = json.loads(text)
        beat = Beat(**data["beat"]) if data["beat"] else None
        return cls(data["rank"], data["kind"], data["seconds"], beat, tuple(data["waiting"]))

    def line(self, watchdog_s: float, latest: str | None, exit_status: int) -> str:
        b = self.beat
        who = f"rank {self.rank} (host {b.host}, pid {b.pid})" if b else f"rank {self.rank}"
        if self.kind == "silent":
            where = f"last heard at step {b.step} in {b.phase}" if b else "it never published its progress"
            what = f"has stopped answering: no heartbeat for {self.seconds:.1f} s (train.watchdog_s {watchdog_s:g}), {where}"
        elif self.kind == "left":
            what = (f"left the run early, at step {b.step} in {b.phase} ({b.early}), while {_ranks(self.waiting)} "
                    f"{'trains' if len(self.waiting) == 1 else 'train'} on")
        elif self.kind == "gone":
            what = (f"is gone: its process ended at step {b.step} in {b.phase} (its last heartbeat) without leaving "
                    f"the run (killed, or os._exit), while {_ranks(self.waiting)} "
                    f"{'trains' if len(self.waiting) == 1 else 'train'} on")
        else:
            what = (f"has made no progress for {self.seconds:.1f} s (train.watchdog_s {watchdog_s:g}) in {b.phase} of "
                    f"step {b.step}, while {_ranks(self.waiting)} further on {'waits' if len(self.waiting) == 1 else 'wait'}"
                    f" for it")
        kept = (f"checkpoints/latest names {latest}, complete before this; the same command resumes from it"
                if latest else "no checkpoint was saved yet")
        return (f"[numloss] watchdog: {who} {what}. Ending the job (exit {exit_status}) instead of waiting "
                f"train.dist_timeout_minutes; {kept}")


def _ranks(ranks: tuple[int, ...], shown: int = 8) -> str:
    head = ", ".join(str(r) for r in ranks[:shown])
    more = f" and {len(ranks) - shown} more" if len(ranks) > shown else ""
    return f"rank{'s' if len(ranks) > 1 else ''} {head}{more}"


def find_stall(seen: dict[int, Seen], now: float, watchdog_s: float, silent_s: float | None = None) -> Stall | None:
    """The rule (module docstring): the first rank that left early or is gone while others train, else the
    longest-silent rank (no heartbeat for `silent_s`, default `watchdog_s`), else the stuck rank furthest
    behind, else None."""
    open_ = {r: s for r, s in seen.items() if not (s.beat is not None and s.beat.closed)}
    left = [(s.heard_at, r, "left") for r, s in seen.items() if s.beat is not None and s.beat.closed and s.beat.early]
    left += [(s.heard_at, r, "gone") for r, s in open_.items() if s.gone and s.beat is not None]
    if left:
        heard_at, rank, kind = min(left)
        others = tuple(sorted(r for r in open_ if r != rank and not open_[r].gone))
        if others:
            return Stall(rank, kind, now - heard_at, seen[rank].beat, others)
    silent_s = watchdog_s if silent_s is None else silent_s
    silent = [(now - s.heard_at, r) for r, s in open_.items() if now - s.heard_at >= silent_s]
    if silent:
        seconds, rank = max(silent)
        return Stall(rank, "silent", seconds, open_[rank].beat, tuple(sorted(r for r in open_ if r != rank)))
    where = {r: s.beat.position() for r, s in open_.items() if s.beat is not None}
    stuck = [(where[r], -(now - s.moved_at), r) for r, s in open_.items()
             if s.beat is not None and s.beat.phase in STEP_PHASES and now - s.moved_at >= watchdog_s
             and any(p > where[r] for p in where.values())]
    if not stuck:
        return None
    _, minus_seconds, rank = min(stuck)
    return Stall(rank, "stuck", -minus_seconds, open_[rank].beat,
                 tuple(sorted(o for o, p in where.items() if p > where[rank])))


def _ended(pid: int, started: str) -> bool:
    """Whether the process `pid` that started at `started` has ended: gone, a zombie, or the pid reused."""
    if process_start(pid) != started:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def start_watchdog(watchdog_s: float, rank: int, world_size: int, checkpoints: Path, exit_status: int,
                   before_exit: Callable[[], None] | None = None) -> Watchdog:
    """This rank's watchdog, on a store connection of its own; off (said on rank 0) where the process
    group's store cannot give one."""
    store = None
    if watchdog_s > 0 and world_size > 1:
        try:
            store = side_store(STORE_TIMEOUT_S)
        except RuntimeError as err:
            if rank == 0:
                print(f"[numloss] watchdog off: no connection of its own to the process group's store ({err})",
                      file=sys.stderr, flush=True)
    return Watchdog(watchdog_s, rank, world_size, store, checkpoints, exit_status, before_exit)


class Watchdog:
    """This rank's publisher and, on ranks 0 and 1, a monitor (module docstring). Every rank makes one
    right after the process group exists and closes it when it leaves training; `store` is a store of
    its own (`runtime.side_store`), None when off."""

    def __init__(self, watchdog_s: float, rank: int, world_size: int, store, checkpoints: Path, exit_status: int,
                 before_exit: Callable[[], None] | None = None):
        global _active
        self.watchdog_s, self.rank, self.store = watchdog_s, rank, store
        self.checkpoints, self.exit_status, self.before_exit = Path(checkpoints), exit_status, before_exit
        self.period = min(max(watchdog_s / 5, 0.2), 10.0)
        self.host, self.pid, self.process_start = socket.gethostname(), os.getpid(), process_start(os.getpid())
        self._phase, self._step, self._moves, self._beats = "start", 0, 0, 0
        self._stop = threading.Event()
        self._wake = threading.Event()  # ends the thread's wait for the next period: a stop, a failed collective
        self._abandoned = False
        self._lost = False  # a collective of this rank failed: a peer's heartbeat that stops for 2 periods is enough
        self._early = ""
        # torchrun's agent hosts the store: once it is gone every store call fails, and torch logs each failure
        # with its C++ stack; the launcher watch stops the run, and the watchdog stops calling the store even if
        # it looks first (the watch polls every 0.5 s, a beat can come between)
        self._store_host = torchrun_agent()
        self._thread: threading.Thread | None = None
        if watchdog_s <= 0 or world_size <= 1 or store is None:
            return
        # each attempt of a restarting launcher has keys of its own, whether or not it reuses the store
        self.prefix = f"{KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self.watched = list(range(world_size)) if rank == 0 else [0, 1] if rank == 1 else []
        self._thread = threading.Thread(target=self._run, name="numloss-watchdog", daemon=True)
        self._thread.start()
        _active = self

    def phase(self, phase: str, step: int) -> None:
        self._phase, self._step, self._moves = phase, step, self._moves + 1

    def abandon(self) -> None:
        """The store is gone with the launcher that hosted it (`recipes.reliability.launcher_watch`): stop
        calling it, and do not wait for a call in flight at `close` (each would wait STORE_TIMEOUT_S)."""
        self._abandoned = True
        self._stop.set()
        self._wake.set()

    def peer_lost(self) -> None:
        """This rank's collective failed (a peer's socket closed, as gloo says when a rank has ended): give the
        watchdog up to three periods to name the rank that left or is gone (it then ends this process, exit
        `exit_status`); returns when it names none, and the caller raises what it caught."""
        if self._thread is None or self._abandoned:
            return
        self._lost = True
        self._wake.set()  # judge now, not at the end of the period
        self._thread.join(timeout=3 * self.period + 5)  # the thread runs on: a verdict ends the process from it

    def close(self, early: str = "") -> None:
        """Stop watching; the thread's last beat says this rank has left (monitors stop judging it). `early`:
        how it left before the run finished on its own ("" when it finished, or stopped with every rank):
        the others name it (module docstring, "left")."""
        global _active
        self._early = early
        if _active is self:
            _active = None
        if self._thread is not None:
            self._stop.set()
            self._wake.set()
            self._thread.join(timeout=0 if self._abandoned else self.period + STORE_TIMEOUT_S)
            self._thread = None

    # ---- the thread ------------------------------------------------------------------------------

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/rank/{rank}"

    def _beat(self, closed: bool = False) -> Beat:
        self._beats += 1
        return Beat(self.rank, self.host, self.pid, self.process_start, self._step, self._phase, self._moves,
                    self._beats, closed, self._early if closed else "")

    def _run(self) -> None:
        started = time.monotonic()
        seen = {r: Seen(None, started, started) for r in self.watched}
        present: set[int] = set()
        reported: str | None = None
        while True:
            try:
                if self._store_host is not None and os.getppid() != self._store_host:
                    self._abandoned = True  # the store went with its host (see __init__)
                if self._abandoned:
                    return
                if self._stop.is_set():
                    self.store.set(self._key(self.rank), json.dumps(asdict(self._beat(closed=True))))
                    return
                self.store.set(self._key(self.rank), json.dumps(asdict(self._beat())))
                verdict, mine = self._verdict(), False
                if verdict is None and seen:
                    self._look(seen, present)
                    stall = find_stall(seen, time.monotonic(), self.watchdog_s,
                                       silent_s=min(self.watchdog_s, 2 * self.period) if self._lost else None)
                    if stall is not None:  # the first verdict written wins; every rank acts on that one
                        payload = stall.to_json()
                        stored = self.store.compare_set(f"{self.prefix}/verdict", "", payload)
                        verdict, mine = Stall.from_json(stored), stored.decode() == payload
                if verdict is not None:
                    self._act(verdict, mine)
            except (RuntimeError, OSError, ValueError) as err:  # the store: say so once, try again next period
                # torch's store errors carry their C++ stack after the first line: one line says what failed
                said = str(err).strip().splitlines()[0] if str(err).strip() else ""
                if said != reported and not self._abandoned:
                    reported = said
                    print(f"[numloss] rank {self.rank}: watchdog: the store did not answer ({type(err).__name__}: "
                          f"{said}); trying again every {self.period:g} s", file=sys.stderr, flush=True)
            self._wake.wait(self.period)
            self._wake.clear()

    def _verdict(self) -> Stall | None:
        key = f"{self.prefix}/verdict"
        return Stall.from_json(self.store.get(key)) if self.store.check([key]) else None

    def _look(self, seen: dict[int, Seen], present: set[int]) -> None:
        for rank in seen:
            if rank not in present and self.store.check([self._key(rank)]):  # multi_get would wait for a missing key
                present.add(rank)
        ranks = sorted(present)
        now = time.monotonic()
        for rank, value in zip(ranks, self.store.multi_get([self._key(r) for r in ranks]) if ranks else []):
            beat = Beat(**json.loads(value))
            seen[rank].update(beat, now)
            # a process of this host that ended without its closing beat (pid and start time: never a reused pid)
            seen[rank].gone = (rank != self.rank and not beat.closed and beat.host == self.host
                               and beat.process_start is not None and _ended(beat.pid, beat.process_start))

    def _act(self, stall: Stall, mine: bool) -> None:
        """Print, kill a silent rank on this host, run the exit callback, end this process."""
        marker = self.checkpoints / "latest"
        latest = marker.read_text().strip() if marker.is_file() else None
        if mine:
            print(stall.line(self.watchdog_s, latest, self.exit_status), file=sys.stderr, flush=True)
        else:
            print(f"[numloss] rank {self.rank}: ending (exit {self.exit_status}): the watchdog named rank "
                  f"{stall.rank} ({stall.kind} for {stall.seconds:.0f} s)", file=sys.stderr, flush=True)
        b = stall.beat
        if (stall.kind == "silent" and b is not None and b.rank != self.rank and b.host == self.host
                and b.process_start is not None and process_start(b.pid) == b.process_start):
            try:
                os.kill(b.pid, signal.SIGKILL)
                done = "sent SIGKILL to"
            except ProcessLookupError:  # it ended since: nothing left to stop
                done = "found gone:"
            print(f"[numloss] rank {self.rank}: {done} rank {b.rank} (pid {b.pid}) on this host", file=sys.stderr, flush=True)
        if self.before_exit is not None:
            try:
                self.before_exit()
            except Exception as err:  # the exit must happen; say what did not
                print(f"[numloss] rank {self.rank}: watchdog: before exiting: {type(err).__name__}: {err}",
                      file=sys.stderr, flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(self.exit_status)
