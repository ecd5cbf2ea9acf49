"""Loaded at start-up by every Python process that has this folder on PYTHONPATH (one torchrun job of a
test). NUMLOSS_TEST_FAULT="RANK:FAULT:STEP" injects one fault on that rank (its RANK variable), at the moment
named, deterministically:

- sigterm_at_save: when the rank writes its state into step STEP's staging directory, SIGTERM to torchrun
  (its parent, which forwards SIGTERM to every rank) and to the rank itself: the delivery of a SLURM
  preemption, landing while the last save is staged;
- slow_commit: at the rename that commits that staging directory (after its checkpoint.json), the same
  SIGTERMs, and the rank then takes 60 s there, so torchrun's shutdown timeout SIGKILLs it mid-commit;
- kill_mid_export: the rank SIGKILLs itself right after writing its shard into the export's staging
  directory (`.final.partial`);
- exit_early: once step STEP is logged (its line in `train.out_dir`/metrics.jsonl, watched from a thread),
  the rank's main thread raises SystemExit(0) (through a SIGUSR2 handler), as a user's code that calls
  `sys.exit(0)` there would: the rank leaves the run with status 0 while the others train on.
Every other process, file and moment is untouched."""

import os

_spec = os.environ.get("NUMLOSS_TEST_FAULT", "")
_rank, _fault, _step = (_spec.split(":") + ["", "", ""])[:3]
if _spec and os.environ.get("RANK") == _rank:
    import signal
    import time

    _staging = f".step_{int(_step or 0):08d}.partial"

    def _stop_the_job():
        os.kill(os.getppid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)

    if _fault == "sigterm_at_save":
        import torch

        _real_save, _sent = torch.save, []

        def _save(obj, f, *args, **kwargs):
            if not _sent and isinstance(f, (str, os.PathLike)) and _staging in os.fspath(f):
                _sent.append(True)
                _stop_the_job()
            return _real_save(obj, f, *args, **kwargs)

        torch.save = _save
    if _fault == "slow_commit":
        _real_replace = os.replace

        def _replace(src, dst, *args, **kwargs):
            if os.fspath(src).endswith(_staging):
                _stop_the_job()
                time.sleep(60)
            return _real_replace(src, dst, *args, **kwargs)

        os.replace = _replace
    if _fault == "kill_mid_export":
        import safetensors.torch

        _real_save_file = safetensors.torch.save_file

        def _save_file(tensors, filename, *args, **kwargs):
            result = _real_save_file(tensors, filename, *args, **kwargs)
            if ".final.partial" in os.fspath(filename):
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        safetensors.torch.save_file = _save_file
    if _fault == "exit_early":
        import threading
        from pathlib import Path

        _argv = Path("/proc/self/cmdline").read_bytes().decode().split("\0")  # sys.argv is not set yet here
        _out = next(a.split("=", 1)[1] for a in _argv if a.startswith("train.out_dir="))

        def _exit(signum, frame):
            raise SystemExit(0)

        def _when_logged():
            metrics = Path(_out) / "metrics.jsonl"
            while not (metrics.exists() and len(metrics.read_text().splitlines()) >= int(_step)):
                time.sleep(0.02)
            os.kill(os.getpid(), signal.SIGUSR2)

        signal.signal(signal.SIGUSR2, _exit)
        threading.Thread(target=_when_logged, daemon=True).start()
