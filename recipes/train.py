"""Train a Hugging Face causal LM with the numeric objective under DeepSpeed.

    torchrun --nproc_per_node 8 -m recipes.train recipes/configs/llama3-8b-gsm8k/smmd.yaml [key=value ...]
    python -m recipes.train RECIPE.yaml          # a world of one

One optimizer step = `grad_accum` micro-batches of `micro_batch_size` rows on each data-parallel rank,
G = micro_batch_size x grad_accum x data-parallel ranks rows in all. Layouts compare: step s trains on
samples [s*G, (s+1)*G) of one seeded order whatever the layout (`data_prep.reader`), and its loss is
normalised over the whole global batch (`recipes.step`), so the same recipe logs the same losses and
gradient norms on 1 rank or 8, with or without accumulation, tensor parallelism or packing.
The run lives in `train.out_dir`: `recipe.yaml` (the resolved recipe), `metrics.jsonl` (one line per
optimizer step), `tb/` (TensorBoard), `checkpoints/` (DeepSpeed checkpoints + `latest`), `final/` (a Hugging
Face safetensors model, one shard per rank with its index, and its tokenizer or processor).

Batches become model inputs in `recipes.batches`: packed shards get block-diagonal attention and
per-example positions. Vision-language recipes (`model.vision: true`) load AutoModelForImageTextToText
and its AutoProcessor; each batch's images are expanded into the prompt by `recipes.vision`, as in
evaluation, and the whole model (tower, projector, language model) trains.

Restarts: a run whose `checkpoints/latest` exists resumes from it by itself: model, optimizer, LR
schedule, the data reader's position and the RNG state, so on CPU the resumed loss curve equals the
uninterrupted one to the bit. It may resume onto another number of data-parallel ranks or another
micro-batch x grad_accum split of the same global batch (`recipes.checkpoints`).

This file is the loop; its parts live beside it: `ds_config` (DeepSpeed config, optimizer, LR schedule),
`model` (backbone and tokenizer), `checkpoints` (save, resume, export), `run_log` (metrics, progress).
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
from numloss import NumericVocab, Objective

from .batches import model_inputs
from .checkpoints import Checkpoints, export
from .config import Recipe, dump_recipe, load_recipe
from .ds_config import build_optimizer, deepspeed_config, lr_lambda
from .model import build_model, load_tokenizer, training_module
from .run_log import MetricsLog, progress_bar
from .runtime import Runtime, setup_distributed, teardown
from .step import DataParallel, reduce_sum, train_step


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
    runtime = setup_distributed(recipe.train.dist_timeout_minutes)
    engine = None
    try:
        engine, last = _train(recipe, runtime, hooks or Hooks())
        return last
    finally:
        teardown(engine)


def _train(recipe: Recipe, runtime: Runtime, hooks: Hooks):
    import deepspeed

    out = Path(recipe.train.out_dir)
    if runtime.is_main:
        out.mkdir(parents=True, exist_ok=True)
        dump_recipe(recipe, out / "recipe.yaml")
    torch.manual_seed(recipe.train.seed)

    ds_config = deepspeed_config(recipe, runtime.world_size)
    tp = recipe.deepspeed.tp_size
    dp = DataParallel.create(runtime.rank, runtime.world_size, tp)

    tokenizer, processor = load_tokenizer(recipe)
    model, live_ds_config = build_model(recipe, ds_config, runtime.device)
    head = model.get_output_embeddings().weight
    logits_width = (head.ds_shape if hasattr(head, "ds_shape") else head.shape)[0]  # ZeRO-3 keeps the full shape aside
    if len(tokenizer) > logits_width:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but the model's logits only {logits_width}")
    vocab = NumericVocab.from_tokenizer(tokenizer, policy=recipe.loss.numeric_policy,
                                        max_value=recipe.loss.numeric_max_value,
                                        space_variants=recipe.loss.space_variants, vocab_size=logits_width)
    objective = Objective(vocab, recipe.objective_config())
    wrapper = training_module(model, objective, recipe)  # AutoTP needs the HF model's config and tp_plan
    checkpoints = Checkpoints(out / "checkpoints", recipe.train.keep_last, runtime,
                              {"data_parallel": dp.size, "tensor_parallel": tp,
                               "zero_stage": recipe.deepspeed.zero_stage})
    checkpoints.prepare_resume(ds_config)  # another data-parallel size: load a universal checkpoint
    optimizer = build_optimizer(recipe, wrapper.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(recipe))
    engine, optimizer, _, scheduler = deepspeed.initialize(model=wrapper, optimizer=optimizer,
                                                           lr_scheduler=scheduler, config=ds_config)
    del live_ds_config  # only needed while the model was built

    global_batch = recipe.train.micro_batch_size * recipe.train.grad_accum * dp.size
    dataset = ShardDataset(recipe.data.train, batch_size=recipe.train.micro_batch_size, rank=dp.rank,
                           world_size=dp.size, global_batch_size=global_batch, seed=recipe.train.seed,
                           shuffle=True, drop_last=True,
                           shuffle_window=recipe.data.shuffle_window, seq_len=recipe.data.seq_len,
                           pad_to_multiple_of=recipe.data.pad_to_multiple_of, pad_id=tokenizer.pad_token_id)
    batch_options = {"processor": processor, "attn_implementation": model.config._attn_implementation,
                     "dtype": getattr(torch, recipe.model.dtype),
                     "pad_to_multiple_of": recipe.data.pad_to_multiple_of, "max_length": recipe.data.seq_len}
    step = checkpoints.load(engine, dataset)
    if runtime.is_main and step:
        print(f"[numloss] resumed {recipe.name} from step {step}", flush=True)
    metrics = MetricsLog(recipe, out, runtime, step)
    progress = progress_bar(recipe, runtime, step)
    stream = batches(dataset)
    last: dict = {}
    try:
        while step < recipe.train.steps:
            started = time.perf_counter()
            lr = scheduler.get_last_lr()[0]  # the rate this step's update uses
            window, tokens = [], 0
            for _ in range(recipe.train.grad_accum):  # the step's micro-batches, read ahead to count them
                inputs, batch_tokens = model_inputs(next(stream), **batch_options)
                window.append({k: v.to(runtime.device) if torch.is_tensor(v) else v for k, v in inputs.items()})
                tokens += batch_tokens
            sums = train_step(engine, wrapper, window, dp)
            step += 1
            sums["tokens"] = tokens
            row = reduce_sum(sums, runtime.device, dp.group)  # every rank, every step: one small all-reduce
            elapsed = time.perf_counter() - started
            row = {"step": step, **{k: v for k, v in row.items() if k != "tokens"},
                   "lr": lr, "grad_norm": _grad_norm(engine), "tokens_per_s": row["tokens"] / elapsed}
            if step % recipe.train.log_every == 0 or step == recipe.train.steps:
                metrics.log(row)
            if hooks.on_log is not None:
                hooks.on_log(row)
            last = row if runtime.is_main else {}
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}")
            if recipe.train.save_every and step % recipe.train.save_every == 0 and step < recipe.train.steps:
                _save(checkpoints, engine, step, dataset, hooks)
        if checkpoints.latest_tag() != f"step_{step:08d}":
            _save(checkpoints, engine, step, dataset, hooks)
        if recipe.train.export:
            export(engine, model, processor or tokenizer, out / "final", runtime, recipe)
    finally:
        metrics.close()
        if progress is not None:
            progress.close()
    return engine, last


def _save(checkpoints: Checkpoints, engine, step: int, dataset: ShardDataset, hooks: Hooks) -> None:
    path = checkpoints.save(engine, step, dataset)
    if hooks.on_checkpoint is not None:
        hooks.on_checkpoint(step, path)


def _grad_norm(engine) -> float | None:
    """The global gradient norm before clipping, as DeepSpeed reports it; None (JSON null) where it
    does not (ZeRO stage 0), rather than a NaN in the metrics."""
    norm = engine.get_global_grad_norm()
    return float(norm) if norm is not None else None


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
