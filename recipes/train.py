"""Train a Hugging Face causal LM with the numeric objective under DeepSpeed.

    torchrun --nproc_per_node 8 -m recipes.train recipes/configs/llama3-8b-gsm8k/smmd.yaml [key=value ...]
    python -m recipes.train RECIPE.yaml          # a world of one

One optimizer step = `grad_accum` micro-batches of `micro_batch_size` rows on each data-parallel rank.
The run lives in `train.out_dir`: `recipe.yaml` (the resolved recipe), `metrics.jsonl` (one line per
optimizer step), `tb/` (TensorBoard), `checkpoints/` (DeepSpeed checkpoints + `latest`), `final/` (a
consolidated Hugging Face safetensors model with its tokenizer, or processor).

Batches become model inputs in `recipes.batches`: packed shards get block-diagonal attention and
per-example positions. Vision-language recipes (`model.vision: true`) load AutoModelForImageTextToText
and its AutoProcessor; each batch's images are expanded into the prompt by `recipes.vision`, as in
evaluation, and the whole model (tower, projector, language model) trains.

Restarts: a run whose `checkpoints/latest` exists resumes from it by itself: model, optimizer, LR
schedule, the data reader's position and the RNG state, so on CPU the resumed loss curve equals the
uninterrupted one to the bit. `latest` is written only after every rank has finished its part of the
save (a barrier, then an atomic rename), so a crash mid-save leaves the previous checkpoint in charge.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from data_prep.reader import ShardDataset
from numloss import NumericVocab, Objective
from numloss.adapters.hf import NumericCausalLM

from .config import Recipe, dump_recipe, load_recipe
from .runtime import Runtime, setup_distributed, teardown
from .batches import model_inputs, packing_error
from .vision import load_processor

LATEST = "latest"


# ---- DeepSpeed configuration ----------------------------------------------------------------------


def deepspeed_config(recipe: Recipe, world_size: int) -> dict:
    """The DeepSpeed config a recipe implies (its `deepspeed.overrides` merged in last)."""
    ds = recipe.deepspeed
    dp = data_parallel_size(recipe, world_size)
    zero: dict = {"stage": ds.zero_stage}
    if ds.zero_stage == 3:
        # gather the 16-bit weights at save time so `final/` can be written without zero_to_fp32
        zero.update(stage3_gather_16bit_weights_on_model_save=True)
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if ds.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    config = {
        "train_micro_batch_size_per_gpu": recipe.train.micro_batch_size,
        "gradient_accumulation_steps": recipe.train.grad_accum,
        "train_batch_size": recipe.train.micro_batch_size * recipe.train.grad_accum * dp,
        "gradient_clipping": recipe.optim.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": recipe.model.dtype == "bfloat16"},
        "steps_per_print": 10**9,  # progress and metrics are ours
        "wall_clock_breakdown": False,
    }
    if ds.tp_size > 1:
        config["tensor_parallel"] = {"autotp_size": ds.tp_size, "vocab_parallel_lm_head": True}
    return _merge(config, ds.overrides)


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def data_parallel_size(recipe: Recipe, world_size: int) -> int:
    tp = recipe.deepspeed.tp_size
    if world_size % tp:
        raise ValueError(f"deepspeed.tp_size={tp} does not divide the world size {world_size}")
    dp = world_size // tp
    gbs = recipe.train.global_batch_size
    if gbs is not None and gbs != recipe.train.micro_batch_size * recipe.train.grad_accum * dp:
        raise ValueError(f"train.global_batch_size={gbs} != micro_batch_size {recipe.train.micro_batch_size}"
                         f" x grad_accum {recipe.train.grad_accum} x data-parallel size {dp}")
    return dp


def build_optimizer(recipe: Recipe, params) -> torch.optim.Optimizer:
    """AdamW with the recipe's settings. With `deepspeed.offload_optimizer` the step runs on the CPU in
    DeepSpeed's vectorised CPU Adam (AdamW mode; a C++ op built on first use): DeepSpeed refuses a
    client torch optimizer under ZeRO-Offload, which would be several times slower there."""
    o = recipe.optim
    kwargs = {"lr": o.lr, "betas": tuple(o.betas), "eps": o.eps, "weight_decay": o.weight_decay}
    if recipe.deepspeed.offload_optimizer:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, adamw_mode=True, **kwargs)
    return torch.optim.AdamW(params, **kwargs)


def lr_lambda(recipe: Recipe):
    """Linear warmup to the peak, then cosine down to `min_lr_ratio` of it (or constant)."""
    warmup, total, floor = recipe.optim.warmup_steps, recipe.train.steps, recipe.optim.min_lr_ratio

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if recipe.optim.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


# ---- model and tokenizer ----------------------------------------------------------------------------


def load_tokenizer(recipe: Recipe):
    """(tokenizer, processor): the processor (vision recipes only, else None) carries the tokenizer."""
    from transformers import AutoTokenizer

    source = recipe.model.tokenizer or recipe.model.name_or_path
    if recipe.model.vision:
        processor = load_processor(source, trust_remote_code=recipe.model.trust_remote_code)
        return processor.tokenizer, processor
    return AutoTokenizer.from_pretrained(source, trust_remote_code=recipe.model.trust_remote_code), None


def build_model(recipe: Recipe, ds_config: dict, device: torch.device):
    """The backbone, built under a live HfDeepSpeedConfig for ZeRO-3 so its weights are partitioned as
    they are created (and HF's own initialisation still runs). Vision recipes load the whole
    image-text model (AutoModelForImageTextToText): tower, projector and language model all train.
    A model built from `model.config` with random weights gets different weights under ZeRO-3 (made
    partition by partition) than under stages 0-2 from the same seed; pretrained weights are the same."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
    )
    from transformers.integrations import HfDeepSpeedConfig

    m = recipe.model
    dtype = getattr(torch, m.dtype)
    attn = m.attn_implementation or _default_attention(device)
    live = HfDeepSpeedConfig(ds_config) if ds_config["zero_optimization"]["stage"] == 3 else None
    auto = AutoModelForImageTextToText if m.vision else AutoModelForCausalLM
    if m.config is not None:
        config = dict(m.config)
        model_type = config.pop("model_type", None)
        if model_type is None:
            raise ValueError("model.config: needs a model_type (e.g. llama)")
        hf_config = AutoConfig.for_model(model_type, **config)
        hf_config._attn_implementation = attn
        model = auto.from_config(hf_config, dtype=dtype)
    else:
        model = auto.from_pretrained(m.name_or_path, dtype=dtype, attn_implementation=attn,
                                                     trust_remote_code=m.trust_remote_code)
    if m.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model, live


def _default_attention(device: torch.device) -> str:
    if device.type == "cuda":
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"


# ---- checkpoints ------------------------------------------------------------------------------------


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


# ---- metrics -----------------------------------------------------------------------------------------


class MetricsLog:
    """metrics.jsonl (+ TensorBoard, + Weights & Biases when configured), on rank 0 only."""

    def __init__(self, recipe: Recipe, out: Path, runtime: Runtime, resumed_step: int):
        self.enabled = runtime.is_main
        self.path = out / "metrics.jsonl"
        self.tb = self.wandb = None
        if not self.enabled:
            return
        if self.path.exists():  # a restart: drop the lines logged after the checkpoint it resumes from
            keep = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= resumed_step]
            self.path.write_text("".join(line + "\n" for line in keep))
        if recipe.train.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out / "tb"), purge_step=resumed_step + 1 if resumed_step else None)
        if recipe.train.wandb_project:
            import wandb  # optional: only when a project is configured

            self.wandb = wandb.init(project=recipe.train.wandb_project, name=recipe.name, config=recipe.to_dict(),
                                    id=recipe.name, resume="allow")

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        step = row["step"]
        if self.tb is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(row, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


# ---- the loop ----------------------------------------------------------------------------------------


def batches(dataset: ShardDataset):
    """Endless iteration over epochs; the dataset's own state says where in which epoch."""
    while True:
        yield from dataset


def reduce_mean(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Mean over data-parallel ranks of a dict of floats (every rank holds the same keys)."""
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    t /= dist.get_world_size()
    return dict(zip(keys, t.tolist()))


@dataclass
class Hooks:
    """Callbacks for an orchestrator (the Ray launcher), called on every rank.

    on_log(row): after each optimizer step, with the row logged to metrics.jsonl (DP-mean values).
    on_checkpoint(step, path): after a checkpoint is complete on every rank and `latest` names it.
    """

    on_log: Callable[[dict], None] | None = None
    on_checkpoint: Callable[[int, Path], None] | None = None


def train(recipe: Recipe, hooks: Hooks | None = None) -> dict:
    """Run (or resume) a recipe; returns the last logged metrics row on rank 0 ({} elsewhere)."""
    runtime = setup_distributed()
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
    dp_rank, dp_size = runtime.rank // tp, runtime.world_size // tp  # AutoTP groups are consecutive ranks

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
    wrapper = NumericCausalLM(model, objective, chunked=recipe.loss.head == "chunked",
                              chunk_size=recipe.loss.chunk_size)
    optimizer = build_optimizer(recipe, wrapper.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(recipe))
    engine, optimizer, _, scheduler = deepspeed.initialize(model=wrapper, optimizer=optimizer,
                                                           lr_scheduler=scheduler, config=ds_config)
    del live_ds_config  # only needed while the model was built

    dataset = ShardDataset(recipe.data.train, batch_size=recipe.train.micro_batch_size, rank=dp_rank,
                           world_size=dp_size, seed=recipe.train.seed, shuffle=True, drop_last=True,
                           shuffle_window=recipe.data.shuffle_window, seq_len=recipe.data.seq_len,
                           pad_to_multiple_of=recipe.data.pad_to_multiple_of, pad_id=tokenizer.pad_token_id)
    batch_options = {"processor": processor, "attn_implementation": model.config._attn_implementation,
                     "dtype": getattr(torch, recipe.model.dtype),
                     "pad_to_multiple_of": recipe.data.pad_to_multiple_of, "max_length": recipe.data.seq_len}
    packing = packing_error(objective.config.terms, dataset.packed, recipe.data.train)
    if packing:
        raise ValueError(packing)
    checkpoints = Checkpoints(out / "checkpoints", recipe.train.keep_last, runtime)
    step = checkpoints.load(engine, dataset)
    if runtime.is_main and step:
        print(f"[numloss] resumed {recipe.name} from step {step}", flush=True)
    metrics = MetricsLog(recipe, out, runtime, step)
    progress = _progress(recipe, runtime, step)
    stream = batches(dataset)
    last: dict = {}
    try:
        while step < recipe.train.steps:
            started = time.perf_counter()
            lr = scheduler.get_last_lr()[0]  # the rate this step's update uses
            sums: dict[str, float] = {}
            tokens = 0
            for _ in range(recipe.train.grad_accum):
                inputs, batch_tokens = model_inputs(next(stream), **batch_options)
                inputs = {k: v.to(runtime.device) if torch.is_tensor(v) else v for k, v in inputs.items()}
                result = engine(**inputs)
                engine.backward(result.loss)
                engine.step()
                for key, value in result.log_dict().items():
                    sums[key] = sums.get(key, 0.0) + value / recipe.train.grad_accum
                tokens += batch_tokens
            step += 1
            sums["tokens"] = tokens
            row = reduce_mean(sums, runtime.device)  # every rank, every step: one small all-reduce
            elapsed = time.perf_counter() - started
            row = {"step": step, **{k: v for k, v in row.items() if k != "tokens"},
                   "lr": lr, "grad_norm": _grad_norm(engine),
                   "tokens_per_s": row["tokens"] * dist.get_world_size() / tp / elapsed}
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


def _progress(recipe: Recipe, runtime: Runtime, start: int):
    if not (recipe.train.progress and runtime.is_main):
        return None
    from tqdm import tqdm

    return tqdm(total=recipe.train.steps, initial=start, desc=recipe.name, unit="step", file=sys.stderr)


def export(engine, model, tokenizer, path: Path, runtime: Runtime, recipe: Recipe) -> None:
    """A consolidated Hugging Face safetensors model and its tokenizer (or processor) in `path` (rank 0
    writes)."""
    if recipe.deepspeed.zero_stage == 3 or recipe.deepspeed.tp_size > 1:
        state = engine._zero3_consolidated_16bit_state_dict()  # a collective: every rank calls it
    else:
        state = engine.module.state_dict()
    if runtime.is_main:
        prefix = "model."  # NumericCausalLM holds the HF model as `.model`
        state = {k[len(prefix):]: v.detach().cpu() for k, v in state.items() if k.startswith(prefix)}
        path.mkdir(parents=True, exist_ok=True)
        if getattr(model, "_weight_conversions", None) is not None:
            # transformers 5 loading under ZeRO-3 records extra legacy renamings whose reverse writes
            # keys such as `language_model.model.model.*` (LLaVA); without the record it saves the
            # class's canonical checkpoint format, the one its own save_pretrained writes.
            model._weight_conversions = None
        model.save_pretrained(str(path), state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(str(path))
    dist.barrier()


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
