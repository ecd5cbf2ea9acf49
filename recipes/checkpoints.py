"""Resumable DeepSpeed checkpoints of a run, and the Hugging Face export at its end (`recipes.export`).

Restarts: `latest` is written only after every rank has finished its part of the save (a barrier, then
an atomic rename), so a crash mid-save leaves the previous checkpoint in charge. Besides DeepSpeed's
own state, each rank saves the data reader's position and its RNG state, and rank 0 the layout
(`layout.json`: data-parallel and tensor-parallel sizes, ZeRO stage).

Another layout: the reader's position is a count of samples of one global order, so a run may resume
onto another number of data-parallel ranks or micro-batch split of the same global batch. DeepSpeed
0.19.8 loads ZeRO optimizer state only onto the data-parallel size that saved it; for another size the
checkpoint is converted once to DeepSpeed's universal format (`deepspeed.checkpoint.ds_to_universal`,
into `<tag>_universal`) and loaded with `checkpoint.load_universal`. A changed tensor-parallel size or
ZeRO stage is refused. Ranks without a file of their own (more ranks than saved) take rank 0's reader
position (the same on every rank) and RNG state.
"""

from __future__ import annotations

import json
import os
import shutil
from argparse import Namespace
from pathlib import Path

import torch
import torch.distributed as dist

from data_prep.reader import ShardDataset

from .config import Recipe
from .runtime import Runtime

LATEST = "latest"


class Checkpoints:
    """DeepSpeed checkpoints under `<out>/checkpoints/step_XXXXXXXX`, a `latest` marker, keep the last K."""

    def __init__(self, root: Path, keep_last: int, runtime: Runtime, layout: dict | None = None):
        self.root, self.keep_last, self.runtime = root, keep_last, runtime
        self.layout = layout or {}  # {"data_parallel", "tensor_parallel", "zero_stage"} of this run
        self._load_tag: str | None = None  # set by prepare_resume when the latest needs conversion

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
        if self.runtime.is_main:
            (self.root / tag / "layout.json").write_text(json.dumps(self.layout))
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
        return self.root / tag

    def prepare_resume(self, ds_config: dict) -> None:
        """Before `deepspeed.initialize`: when the latest checkpoint was saved at another data-parallel
        size, convert it to DeepSpeed's universal format (rank 0, once) and set `ds_config` to load
        that. Refuses a changed tensor-parallel size or ZeRO stage. Every rank calls it."""
        tag = self.latest_tag()
        saved_file = self.root / tag / "layout.json" if tag else None
        if saved_file is None or not saved_file.is_file():
            return
        saved = json.loads(saved_file.read_text())
        for key in ("tensor_parallel", "zero_stage"):
            if saved.get(key) != self.layout.get(key):
                raise ValueError(f"{self.root / tag} was saved with {key}={saved.get(key)}; this run has"
                                 f" {self.layout.get(key)}: resume with the same {key}")
        if saved.get("data_parallel") == self.layout.get("data_parallel"):
            return
        universal = f"{tag}_universal"
        if self.runtime.is_main and not (self.root / universal).is_dir():
            from deepspeed.checkpoint.ds_to_universal import main as to_universal

            tmp = self.root / f".{universal}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            to_universal(Namespace(input_folder=str(self.root / tag), output_folder=str(tmp), num_extract_workers=1,
                                   num_merge_workers=1, keep_temp_folder=False, strict=True,
                                   inject_missing_state=False))
            os.replace(tmp, self.root / universal)
        dist.barrier()
        ds_config["checkpoint"] = {**ds_config.get("checkpoint", {}), "load_universal": True}
        self._load_tag = universal

    def load(self, engine, dataset: ShardDataset) -> int:
        """Restore the latest checkpoint; returns the step it was saved at (0: none)."""
        tag = self.latest_tag()
        if tag is None:
            return 0
        path, client = engine.load_checkpoint(str(self.root), tag=self._load_tag or tag)
        if path is None:
            raise RuntimeError(f"checkpoint {self.root / tag} named by {LATEST} could not be loaded")
        own = self.root / tag / f"rank_{self.runtime.rank:05d}.pt"
        state = torch.load(own if own.is_file() else self.root / tag / "rank_00000.pt", weights_only=False)
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
