"""Run `recipes.train` as a real 2-rank torchrun job on CPU (gloo) and read what it logged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def launch(recipe: Path, out_dir: Path, *overrides: str, nproc: int = 2) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "recipes.train", str(recipe), f"train.out_dir={out_dir}", *overrides]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def run_to_end(recipe: Path, out_dir: Path, *overrides: str) -> str:
    proc = launch(recipe, out_dir, *overrides)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-4000:]
    return output


def read_metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
