"""How long a stop request's save takes, against the time a cluster gives it before SIGKILL.

A stop request (SIGTERM, SIGUSR1, the PREEMPT file: `recipes.reliability.preemption`) is acted on at the
next step boundary, so the current step finishes first; then the checkpoint is saved: every byte written
(the ranks in parallel, at the storage's aggregate bandwidth), then read back and hashed, every file
fsynced (`recipes.reliability.checkpoints`: the verification), about twice the checkpoint's bytes through
the storage; then the ranks tear down. So from the request to the exit:

    stop_s = step_s + 2 x checkpoint bytes / storage bandwidth + TEARDOWN_S

Who gives that time, and what happens when it is too short:
- torchrun, after its own SIGTERM, waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT (torch's default 30 s; the SLURM
  templates set `torchrun_shutdown_timeout_s`: max(cluster.preempt_notice_s, 300)), then SIGKILLs the
  ranks. A save cut short there after its checkpoint.json is committed at the next start; one cut short
  before it is lost (the previous checkpoint resumes).
- SLURM, on a preemption, a time limit or `scancel`, signals every process and SIGKILLs after KillWait
  (30 s by default) or the partition's GraceTime, whatever torchrun waits; with `--signal=B:USR1@N`
  (`cluster.preempt_notice_s` = N) the request comes N s before the time limit, so the save has N s.
Pure arithmetic on numbers the planner gives (`Plan.checkpoint_bytes`, `Plan.step_s`) and an assumed storage
bandwidth (`STORAGE_GBPS`).
"""

from __future__ import annotations

import math

# GB/s of aggregate checkpoint writes and reads (an assumption, not measured: a parallel file system's rate);
# validate prices every save with it (the stop's here, the cadence's in the DeepSpeed report)
STORAGE_GBPS = 10.0
TEARDOWN_S = 30.0  # the process groups, the engine and the interpreter's exit (a margin, not measured at scale)
TORCHRUN_DEFAULT_SHUTDOWN_S = 30  # torch's own TORCH_ELASTIC_SHUTDOWN_TIMEOUT
TEMPLATE_MIN_SHUTDOWN_S = 300
SLURM_KILL_WAIT_S = 30  # SLURM's default KillWait


def torchrun_shutdown_timeout_s(preempt_notice_s: int) -> int:
    """The TORCH_ELASTIC_SHUTDOWN_TIMEOUT the SLURM templates set: the notice, and never under 300 s."""
    return max(int(preempt_notice_s), TEMPLATE_MIN_SHUTDOWN_S)


def save_s(checkpoint_bytes: float, storage_gbps: float) -> float:
    """Seconds to write a checkpoint and read it back for its checksums, at `storage_gbps` GB/s aggregate."""
    return 2 * checkpoint_bytes / (storage_gbps * 1e9)


def stop_s(checkpoint_bytes: float, step_s: float, storage_gbps: float) -> float:
    """Seconds from a stop request to the ranks' exit (module docstring)."""
    return step_s + save_s(checkpoint_bytes, storage_gbps) + TEARDOWN_S


def needed_shutdown_timeout_s(checkpoint_bytes: float, step_s: float, storage_gbps: float) -> int:
    """The shortest shutdown timeout that lets a stop request's save finish, in whole minutes."""
    return 60 * math.ceil(stop_s(checkpoint_bytes, step_s, storage_gbps) / 60)


def shutdown_warnings(checkpoint_bytes: float | None, step_s: float, storage_gbps: float,
                      preempt_notice_s: int) -> list[str]:
    """What `recipes.validate` warns when a stop request's save cannot finish in the time the SLURM templates
    and SLURM give it (module docstring); [] when it fits or the plan has no checkpoint size or step time."""
    if not checkpoint_bytes or not math.isfinite(step_s):
        return []
    needed = stop_s(checkpoint_bytes, step_s, storage_gbps)
    how = (f"a stop request's save takes ~{needed:.0f} s (the current step {step_s:.0f} s + writing and reading back "
           f"{checkpoint_bytes / 1e9:,.0f} GB at {storage_gbps:g} GB/s + {TEARDOWN_S:.0f} s)")
    raise_to = needed_shutdown_timeout_s(checkpoint_bytes, step_s, storage_gbps)
    found = []
    torchrun = torchrun_shutdown_timeout_s(preempt_notice_s)
    if needed > torchrun:
        found.append(f"cluster.preempt_notice_s: {how}, more than torchrun's shutdown timeout in the SLURM templates "
                     f"(TORCH_ELASTIC_SHUTDOWN_TIMEOUT {torchrun} s): raise cluster.preempt_notice_s to {raise_to} "
                     f"(the templates set the timeout to it), or the save is cut short (SIGKILL)")
    if preempt_notice_s <= 0 and needed > SLURM_KILL_WAIT_S:
        found.append(f"cluster.preempt_notice_s: 0: {how}; without the notice a preemption or time limit leaves "
                     f"SLURM's KillWait ({SLURM_KILL_WAIT_S} s by default) before SIGKILL: set "
                     f"cluster.preempt_notice_s to {raise_to} (or ask for a KillWait / GraceTime that long)")
    elif 0 < preempt_notice_s < needed <= torchrun:
        found.append(f"cluster.preempt_notice_s: {preempt_notice_s} s: {how}, more than the notice before the time "
                     f"limit: raise it to {raise_to}")
    return found
