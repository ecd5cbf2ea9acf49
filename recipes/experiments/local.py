"""Run a recipe on this machine: `torchrun --standalone` with N processes (CPU ranks or local GPUs).

The in-repo callers (the demo, the study) use this; clusters use `launch/` (Ray, SLURM).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_recipe(recipe: str | Path, overrides: list[str], nproc: int = 2, log=print, quiet: bool = False) -> float:
    """Train `recipe` with `overrides` on `nproc` local processes; returns the wall time in seconds.

    On CPU each rank gets one thread (2 ranks on 2 cores); the run's output goes to the terminal, or to
    `<train.out_dir>/train.log` when `quiet`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "recipes.train", str(recipe), *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "TOKENIZERS_PARALLELISM": "false"}
    started = time.time()
    if quiet:
        out_dir = next((o.split("=", 1)[1] for o in overrides if o.startswith("train.out_dir=")), None)
        if out_dir is None:
            raise ValueError("quiet=True needs a train.out_dir=... override to put train.log in")
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(out_dir) / "train.log", "w") as log_file:
            result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        if result.returncode:
            tail = (Path(out_dir) / "train.log").read_text()[-3000:]
            raise RuntimeError(f"training failed ({result.returncode}): {' '.join(cmd)}\n{tail}")
    else:
        subprocess.run(cmd, cwd=REPO_ROOT, env=env, check=True)
    return time.time() - started
