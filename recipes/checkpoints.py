"""Resumable DeepSpeed checkpoints of a run, and the Hugging Face export at its end (`recipes.export`).

Restarts: `latest` is written only after every rank has finished its part of the save (a barrier, then
an atomic rename), so a crash mid-save leaves the previous checkpoint in charge. Besides DeepSpeed's
own state, each rank saves the data reader's position and its RNG state.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from data_prep.reader import ShardDataset

from .config import Recipe
from .runtime import Runtime

LATEST = "latest"


class Checkpoints:
    """DeepSpeed checkpoints under `<out>/checkpoints/step_XXXXXXXX`, a `latest` marker, keep the last K."""

    def __init__(self, root: Path, keep_last: int, runtime: Runtime):
        self.root, self.keep_last, self.runtime = root, keep_last, runtime

    def latest_tag(self) -> str | None:
        marker = self.root / LATEST
        return marker.read_text().strip() if marker.is_file() else None

    def save(self, engine, step: int, dataset: ShardDataset) -> Path:
        tag = f"step_{step:08d}"
        engine.save_checkpoint(str(self.root), tag=tag, client_state={"step": step}, save_latest=False)
        # per rank: the reader's position and the RNG (data and dropout continue exactly)
        torch.save({"data": dataset.state_dict(), "rng": torch.get_rng_state(),
                    "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None},
                   self.root / tag / f"rank_{self.runtime.rank:05d}.pt")
        dist.barrier()  # every rank's files are complete before `latest` moves
        if self.runtime.is_main:
            tmp = self.root / f".{LATEST}.tmp"
            tmp.write_text(tag)
            os.replace(tmp, self.root / LATEST)
            tags = sorted(p.name for p in self.root.glob("step_*") if p.is_dir())
            for old in tags[:-self.keep_last]:
                shutil.rmtree(self.root / old, ignore_errors=True)
        dist.barrier()
        return self.root / tag

    def load(self, engine, dataset: ShardDataset) -> int:
        """Restore the latest checkpoint; returns the step it was saved at (0: none)."""
        tag = self.latest_tag()
        if tag is None:
            return 0
        path, client = engine.load_checkpoint(str(self.root), tag=tag)
        if path is None:
            raise RuntimeError(f"checkpoint {self.root / tag} named by {LATEST} could not be loaded")
        state = torch.load(self.root / tag / f"rank_{self.runtime.rank:05d}.pt", weights_only=False)
        dataset.load_state_dict(state["data"])
        torch.set_rng_state(state["rng"])
        if state["cuda_rng"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda_rng"])
        return int(client["step"])


def export(engine, model, tokenizer, path: Path, runtime: Runtime, recipe: Recipe) -> None:
    """The Hugging Face export in `path`: sharded safetensors that every rank writes its share of, with
    transformers' index file, plus config and tokenizer (or processor); see `recipes.export`."""
    from .export import export_model

    export_model(engine, model, tokenizer, path, runtime, zero_stage=recipe.deepspeed.zero_stage,
                 tp_size=recipe.deepspeed.tp_size)
