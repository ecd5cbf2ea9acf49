"""A run's checkpoint directories, whichever engine fills them: `<out>/checkpoints/step_XXXXXXXX`, the
`latest` marker, the last `keep_last` kept.

Restarts: `latest` is written only after every rank has finished its part of the save (a barrier, then
an atomic rename), so a crash mid-save leaves the previous checkpoint in charge. The engine writes its
own state (model, optimizer, schedule) into the step directory; beside it each rank saves the data
reader's position and its RNG state (`rank_XXXXX.pt`), and rank 0 the layout (`layout.json`) that the
engine compares at resume. The reader's position is a count of samples of one global order, so it does
not depend on the layout; ranks without a file of their own (more ranks than saved) take rank 0's
(the same position, and rank 0's RNG state).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from data_prep.reader import ShardDataset

from .runtime import Runtime

LATEST = "latest"


def step_tag(step: int) -> str:
    return f"step_{step:08d}"


class CheckpointDirs:
    """The step directories of one run. Every method is called on every rank (they hold barriers)."""

    def __init__(self, root: Path, keep_last: int, runtime: Runtime):
        self.root, self.keep_last, self.runtime = Path(root), keep_last, runtime

    def latest_tag(self) -> str | None:
        marker = self.root / LATEST
        return marker.read_text().strip() if marker.is_file() else None

    def saved_layout(self) -> dict | None:
        """The layout the latest checkpoint was saved with (None: no checkpoint, or none recorded)."""
        tag = self.latest_tag()
        path = self.root / tag / "layout.json" if tag else None
        return json.loads(path.read_text()) if path is not None and path.is_file() else None

    def save(self, step: int, dataset: ShardDataset, save_state: Callable[[Path], None], layout: dict) -> Path:
        """`save_state(directory)` writes the engine's state (every rank, collectively); then this rank's
        reader position and RNG, rank 0's `layout.json`, and `latest` once every rank is done."""
        tag = step_tag(step)
        directory = self.root / tag
        if self.runtime.is_main:
            directory.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        save_state(directory)
        torch.save({"step": step, "data": dataset.state_dict(), "rng": torch.get_rng_state(),
                    "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None},
                   directory / f"rank_{self.runtime.rank:05d}.pt")
        if self.runtime.is_main:
            (directory / "layout.json").write_text(json.dumps(layout))
        dist.barrier()  # every rank's files are complete before `latest` moves
        if self.runtime.is_main:
            tmp = self.root / f".{LATEST}.tmp"
            tmp.write_text(tag)
            os.replace(tmp, self.root / LATEST)
            tags = sorted(p.name for p in self.root.glob("step_*") if p.is_dir())
            for old in [t for t in tags if not t.endswith("_universal")][:-self.keep_last]:
                shutil.rmtree(self.root / old, ignore_errors=True)
                shutil.rmtree(self.root / f"{old}_universal", ignore_errors=True)
        dist.barrier()
        return directory

    def load(self, dataset: ShardDataset, load_state: Callable[[Path], None]) -> int:
        """Restore the latest checkpoint: `load_state(directory)` (the engine's state, every rank), then
        the reader position and RNG; returns the step it was saved at (0: none)."""
        tag = self.latest_tag()
        if tag is None:
            return 0
        directory = self.root / tag
        load_state(directory)
        own = directory / f"rank_{self.runtime.rank:05d}.pt"
        state = torch.load(own if own.is_file() else directory / "rank_00000.pt", weights_only=False)
        dataset.load_state_dict(state["data"])
        torch.set_rng_state(state["rng"])
        if state["cuda_rng"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda_rng"])
        return int(state["step"]) if "step" in state else int(tag.split("_")[1])
