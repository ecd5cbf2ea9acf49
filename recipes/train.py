"""Train a causal LM with the numeric objective, on DeepSpeed or Megatron-core (`train.engine`).

    torchrun --nproc_per_node 8 -m recipes.train recipes/configs/llama3-8b-gsm8k/smmd.yaml [key=value ...]
    python -m recipes.train RECIPE.yaml          # a world of one

One optimizer step = `grad_accum` micro-batches of `micro_batch_size` rows on each data-parallel rank,
G = micro_batch_size x grad_accum x data-parallel ranks rows in all. Layouts compare: step s trains on
samples [s*G, (s+1)*G) of one seeded order whatever the layout (`data_prep.reader`), and its loss is
normalised over the whole global batch (`recipes.training.parallel`), so the same recipe logs the same losses and
gradient norms on 1 rank or 8, with or without accumulation, tensor parallelism or packing.
The run lives in `train.out_dir`: `recipe.yaml` (the resolved recipe), `metrics.jsonl` (one line per
optimizer step), `tb/` (TensorBoard), `checkpoints/` (the engine's checkpoints + `latest`), `final/` (a
Hugging Face safetensors model, sharded, with its index, and its tokenizer or processor).

Batches become model inputs in `recipes.training.batches`: packed shards get block-diagonal attention and
per-example positions. Vision-language recipes (`model.vision: true`) load AutoModelForImageTextToText
and its AutoProcessor; each batch's images are expanded into the prompt by `recipes.training.vision`, as in
evaluation, and the whole model (tower, projector, language model) trains (DeepSpeed engine only).

Restarts: a run whose `checkpoints/latest` exists resumes from it by itself: model, optimizer, LR
schedule, the data reader's position and the RNG state, so on CPU the resumed loss curve equals the
uninterrupted one to the bit. It may resume onto another number of data-parallel ranks or another
micro-batch x grad_accum split of the same global batch (`recipes.training.checkpoints`, and each
engine's own rules: `recipes.engines.*`).

This file is the loop, the same for every engine (`recipes.training.engine.Engine` is what it calls);
its shared parts are in `recipes.training`, the engines in `recipes.engines`.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from data_prep.reader import ShardDataset

from .config import Recipe, dump_recipe, load_recipe
from .engines import build_engine
from .training.batches import model_inputs
from .training.checkpoints import CheckpointDirs, step_tag
from .training.diagnostics import diagnosed, finish_row, logged
from .training.engine import Engine
from .training.parallel import reduce_sum
from .training.run_log import MetricsLog, progress_bar
from .training.runtime import Runtime, setup_distributed, teardown


def batches(dataset: ShardDataset):
    """Endless iteration over epochs; the dataset's own state says where in which epoch."""
    while True:
        yield from dataset


@dataclass
class Hooks:
    """Callbacks for an orchestrator (the Ray launcher), called on every rank.

    on_log(row): after each optimizer step, with the row logged to metrics.jsonl (the global batch's values).
    on_checkpoint(step, path): after a checkpoint is complete on every rank and `latest` names it.
    """

    on_log: Callable[[dict], None] | None = None
    on_checkpoint: Callable[[int, Path], None] | None = None


def train(recipe: Recipe, hooks: Hooks | None = None) -> dict:
    """Run (or resume) a recipe; returns the last logged metrics row on rank 0 ({} elsewhere)."""
    runtime = setup_distributed(recipe.train.dist_timeout_minutes, deepspeed=recipe.train.engine == "deepspeed")
    engine = None
    try:
        out = Path(recipe.train.out_dir)
        if runtime.is_main:
            out.mkdir(parents=True, exist_ok=True)
            dump_recipe(recipe, out / "recipe.yaml")
        torch.manual_seed(recipe.train.seed)
        dirs = CheckpointDirs(out / "checkpoints", recipe.train.keep_last, runtime)
        engine = build_engine(recipe, runtime, dirs)
        return _train(recipe, runtime, engine, dirs, hooks or Hooks())
    finally:
        teardown(engine)


def _train(recipe: Recipe, runtime: Runtime, engine: Engine, dirs: CheckpointDirs, hooks: Hooks) -> dict:
    out = Path(recipe.train.out_dir)
    dp = engine.dp
    global_batch = recipe.train.micro_batch_size * recipe.train.grad_accum * dp.size
    dataset = ShardDataset(recipe.data.train, batch_size=recipe.train.micro_batch_size, rank=dp.rank,
                           world_size=dp.size, global_batch_size=global_batch, seed=recipe.train.seed,
                           shuffle=True, drop_last=True,
                           shuffle_window=recipe.data.shuffle_window, seq_len=recipe.data.seq_len,
                           pad_to_multiple_of=recipe.data.pad_to_multiple_of, pad_id=engine.tokenizer.pad_token_id)
    step = dirs.load(dataset, engine.load_state)
    if runtime.is_main and step:
        print(f"[numloss] resumed {recipe.name} from step {step}", flush=True)
    if runtime.is_main:
        print(f"[numloss] engine {engine.name}, optimizer {engine.optimizer_name}, layout {engine.layout}", flush=True)
    metrics = MetricsLog(recipe, out, runtime, step)
    progress = progress_bar(recipe, runtime, step)
    stream = batches(dataset)
    last: dict = {}
    try:
        while step < recipe.train.steps:
            started = time.perf_counter()
            lr = engine.lr()  # the rate this step's update uses
            window, tokens = [], 0
            for _ in range(recipe.train.grad_accum):  # the step's micro-batches, read ahead to count them
                inputs, batch_tokens = model_inputs(next(stream), **engine.batch_options)
                window.append({k: v.to(runtime.device) if torch.is_tensor(v) else v for k, v in inputs.items()})
                tokens += batch_tokens
            sums = engine.train_step(window, diagnostics=diagnosed(recipe, step + 1))
            step += 1
            sums["tokens"] = tokens
            row = reduce_sum(sums, runtime.device, dp.group)  # every rank, every step: one small all-reduce
            elapsed = time.perf_counter() - started
            row = {"step": step, **{k: v for k, v in row.items() if k != "tokens"},
                   "lr": lr, "grad_norm": engine.grad_norm(), "tokens_per_s": row["tokens"] / elapsed}
            row = finish_row(row, recipe.optim.grad_clip)  # gradient diagnostics: global-batch values
            if logged(recipe, step):
                metrics.log(row)
            if hooks.on_log is not None:
                hooks.on_log(row)
            last = row if runtime.is_main else {}
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}")
            if recipe.train.save_every and step % recipe.train.save_every == 0 and step < recipe.train.steps:
                _save(dirs, engine, step, dataset, hooks)
        if dirs.latest_tag() != step_tag(step):
            _save(dirs, engine, step, dataset, hooks)
        if recipe.train.export:
            engine.export(out / "final")
    finally:
        metrics.close()
        if progress is not None:
            progress.close()
    return last


def _save(dirs: CheckpointDirs, engine: Engine, step: int, dataset: ShardDataset, hooks: Hooks) -> None:
    path = dirs.save(step, dataset, lambda directory: engine.save_state(directory, step), engine.layout)
    if hooks.on_checkpoint is not None:
        hooks.on_checkpoint(step, path)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if argv else 2)
    recipe = load_recipe(argv[0], argv[1:])
    last = train(recipe)
    if last:
        print(json.dumps(last), flush=True)


if __name__ == "__main__":
    main()
