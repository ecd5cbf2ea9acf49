"""What a run reports while it trains: metrics.jsonl, TensorBoard, the trackers (Weights & Biases, MLflow:
`recipes.training.tracking`) and a progress bar."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from recipes.config import Recipe

from .runtime import Runtime
from .tracking import Trackers


def nonfinite_keys(row: dict) -> list[str]:
    """The keys of a metrics row whose value is a NaN or inf number (None, a value the engine has not, is fine)."""
    return [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]


def strict_json_row(row: dict) -> dict:
    """A row every strict JSON reader accepts: non-finite numbers as null, named under "nonfinite"."""
    bad = nonfinite_keys(row)
    if not bad:
        return row
    return {**{k: (None if k in bad else v) for k, v in row.items()}, "nonfinite": bad}


class MetricsLog:
    """metrics.jsonl (+ TensorBoard, + W&B / MLflow when configured: the same rows), on rank 0 only."""

    def __init__(self, recipe: Recipe, out: Path, runtime: Runtime, resumed_step: int):
        self.enabled = runtime.is_main
        self.path = out / "metrics.jsonl"
        self.tb = self.trackers = None
        if not self.enabled:
            return
        if self.path.exists():  # a restart: drop the rows logged after the checkpoint it resumes from
            truncate_rows(self.path, resumed_step)
        if recipe.train.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out / "tb"), purge_step=resumed_step + 1 if resumed_step else None)
        self.trackers = Trackers(recipe, out, resumed_step)  # W&B / MLflow, as train.tracking names them

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        append_row(self.path, row)
        step = row["step"]
        if self.tb is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, step)
        self.trackers.log(strict_json_row(row))

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.trackers is not None:
            self.trackers.close()


def append_row(path: Path, row: dict) -> None:
    """One strict-JSON line (NaN/inf as null, `recipes.reliability.health`) appended in one write(2) to an
    O_APPEND file: a line is never interleaved with another or half-rewritten by a truncation."""
    data = (json.dumps(strict_json_row(row), allow_nan=False) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def truncate_rows(path: Path, last_step: int) -> None:
    """Keep the rows of steps <= `last_step` (the checkpoint a run resumes from), once each, in order;
    a torn last line (a crash mid-write) goes too. Written to a temporary file and renamed over."""
    kept: dict[int, str] = {}
    for line in path.read_text().splitlines():
        try:
            step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
        if step <= last_step:
            kept.setdefault(step, line)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(kept[s] + "\n" for s in sorted(kept)))
    os.replace(tmp, path)


def progress_bar(recipe: Recipe, runtime: Runtime, start: int):
    if not (recipe.train.progress and runtime.is_main):
        return None
    from tqdm import tqdm

    return tqdm(total=recipe.train.steps, initial=start, desc=recipe.name, unit="step", file=sys.stderr)
