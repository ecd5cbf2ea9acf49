"""The DeepSpeed engine: a Hugging Face causal LM wrapped with the numeric objective under DeepSpeed
ZeRO (0-3), optionally AutoTP (`deepspeed.tp_size`), on GPUs or CPU ranks.

One optimizer step: the step's global counts are reduced over the data-parallel group, then each
micro-batch runs forward with them (its loss is its share of the global batch's loss) and backward.
DeepSpeed 0.19.8 divides each micro-batch's loss by `gradient_accumulation_steps` in
`engine.backward` and averages gradients over the data-parallel ranks in its ZeRO reductions; the
loss given to backward is multiplied by `grad_accum * dp` to undo both, so the update is the gradient
of the global batch's loss at any layout. AutoTP ranks hold the same rows and labels and compute the
same loss.

Mixture-of-experts models (`recipes.engines.deepspeed.runtime.moe`): each micro-batch's router/aux
(`recipes.training.router_loss`) goes to backward unscaled, so that DeepSpeed's mean makes the update
the gradient of the step's mean router/aux over micro-batches and ranks; the logged `loss` is the
objective plus that mean, and `router/aux` is logged beside the terms.

LoRA (`model.lora`, `recipes.engines.deepspeed.runtime.lora`): the adapters are injected before the wrapper is
built, the optimizer and the checkpoints hold the adapters only (the frozen base is rebuilt at every
start), and the export writes the adapter (`final/adapter/`) and, with `model.lora.export_merged`, the
merged model in `final/`.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from numloss import NumericVocab, Objective
from numloss.normalization import reduce_counts
from recipes.config import Recipe
from recipes.reliability.checkpoints import CheckpointDirs
from recipes.reliability.export_writer import ExportRecord
from recipes.training.held_out import answer_tokens, vocab_parallel_argmax
from recipes.training.parallel import DataParallel, step_counts
from recipes.training.runtime import Runtime, clear_method_caches, setup_distributed
from recipes.training.schedule import apply_recipe_schedule, lr_lambda
from recipes.inputs.tokenizer import load_tokenizer

from . import checkpoints
from ..pure.config import deepspeed_config
from .distributed import init_process_group
from ..pure.contract import run_layout
from .export import export_model
from .lora import apply_lora, save_adapter, trainable_parameters
from .model import attention_used, build_model, training_module
from .optimizer import build_optimizer
from .ulysses import Ulysses, split_batch


class DeepSpeedEngine:
    """`recipes.training.engine.Engine` on DeepSpeed; see the module docstring."""

    name = "deepspeed"

    @staticmethod
    def join_process_group(timeout_minutes: float) -> Runtime:
        """This rank's process group, through deepspeed.comm (recipes.engines.deepspeed.runtime.distributed)."""
        return setup_distributed(timeout_minutes, init_group=init_process_group)

    def __init__(self, recipe: Recipe, runtime: Runtime, dirs: CheckpointDirs):
        import deepspeed

        self.recipe, self.runtime = recipe, runtime
        ds_config = deepspeed_config(recipe, runtime.world_size, pin_memory=torch.cuda.is_available())
        tp, sp = recipe.deepspeed.tp_size, recipe.deepspeed.sp_size
        self.dp = DataParallel.tensor_parallel_first(runtime.rank, runtime.world_size, tp)
        self.tokenizer, self.processor = load_tokenizer(recipe)
        model, live_ds_config = build_model(recipe, ds_config, runtime.device)
        self.ulysses = None
        if sp > 1:  # every rank of a sequence-parallel group reads the same rows (recipes.engines.deepspeed.runtime.ulysses)
            self.ulysses = Ulysses(model, sp, recipe.train.micro_batch_size, attention_used(model))
            self.dp = DataParallel(runtime.rank // sp, runtime.world_size // sp, self.ulysses.data_group)
        self.layout = run_layout(recipe, self.dp.size)
        # DeepSpeed 0.19.8 sums gradients over the sequence x data-parallel group and divides by the data-
        # parallel size (world / sp), except ZeRO-3's reduce-scatter (`reduce_scatter_coalesced`), which
        # divides by every rank of that group: there each rank's loss is scaled by sp more (measured:
        # without it the gradient norm at sp 2 is half sp 1's, at ZeRO-0 and -2 it is equal)
        self._zero3_sequence_factor = sp if sp > 1 and recipe.deepspeed.zero_stage == 3 else 1
        self.lora = recipe.model.lora
        self.peft_model = None
        if self.lora is not None:
            self.peft_model = apply_lora(model, self.lora, recipe.model.gradient_checkpointing)
        head = model.get_output_embeddings().weight
        logits_width = (head.ds_shape if hasattr(head, "ds_shape") else head.shape)[0]  # ZeRO-3 keeps the full shape aside
        if len(self.tokenizer) > logits_width:
            raise ValueError(f"tokenizer has {len(self.tokenizer)} tokens but the model's logits only {logits_width}")
        vocab = NumericVocab.from_tokenizer(self.tokenizer, policy=recipe.loss.numeric_policy,
                                            max_value=recipe.loss.numeric_max_value,
                                            space_variants=recipe.loss.space_variants, vocab_size=logits_width)
        objective = Objective(vocab, recipe.loss.objective)
        self.model = model
        self.hf_config = model.config  # recipes.training.throughput: FLOPs per token
        self.timings: dict[str, float] = {}
        self._own_norm: float | None = None  # ZeRO stage 0: the step's gradient norm, measured here
        self.wrapper = training_module(model, objective, recipe)  # AutoTP needs the HF model's config and tp_plan
        self._load_tag = checkpoints.universal_tag_to_load(dirs, self.layout, ds_config)
        optimizer, self.optimizer_name = build_optimizer(recipe, trainable_parameters(self.wrapper))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(recipe))
        mpu = {} if self.ulysses is None else {"mpu": self.ulysses.mpu}
        self.engine, _, _, self.scheduler = deepspeed.initialize(model=self.wrapper, optimizer=optimizer,
                                                                 lr_scheduler=scheduler, config=ds_config, **mpu)
        del live_ds_config  # only needed while the model was built
        self.batch_options = {"processor": self.processor, "attn_implementation": model.config._attn_implementation,
                              "dtype": getattr(torch, recipe.model.dtype),
                              "pad_to_multiple_of": recipe.data.pad_to_multiple_of,
                              "max_length": recipe.data.seq_len}

    def train_step(self, window: list[dict], diagnostics: bool = False) -> dict[str, float]:
        # every submodule in train mode: from_pretrained returns the model in eval mode, where HF skips its
        # dropout and its gradient checkpointing (the Megatron engine trains its chunks in train mode too)
        self.engine.module.train()
        if self.ulysses is not None:  # labels shifted on the whole rows, then each rank's slice
            window = [split_batch(inputs, self.ulysses.sequence) for inputs in window]
            counts = reduce_counts([self.wrapper.counts(None, sequence_split=inputs["sequence_split"])
                                    for inputs in window], group=self.dp.group)  # over data x sequence parallel
        else:
            counts = step_counts(self.wrapper.counts, window, self.dp)
        scale = len(window) * self.dp.size * self._zero3_sequence_factor  # undo DeepSpeed's mean over micro-batches and ranks
        sums: dict[str, float] = {}
        started = time.perf_counter()
        for i, inputs in enumerate(window):
            result = self.engine(**inputs, loss_counts=counts, diagnostics=diagnostics)
            aux = result.get("router_aux")  # mixture-of-experts: this micro-batch's router/aux
            # router/aux unscaled: DeepSpeed's mean over micro-batches and ranks makes its gradient that of
            # the step's mean router/aux, as Megatron's MoEAuxLossAutoScaler does (recipes.training.router_loss)
            self.engine.backward(result.loss * scale if aux is None else result.loss * scale + aux)
            if i == len(window) - 1:  # the step's time split (recipes.training.throughput): 2 syncs per step
                _synchronize(self.runtime.device)
                backward_done = time.perf_counter()
                self._own_norm = self._gradient_norm() if self.recipe.deepspeed.zero_stage == 0 else None
            self.engine.step()  # the optimizer runs at the last micro-batch (the accumulation boundary)
            logged = result.log_dict()
            if aux is not None:  # the step's loss is objective + router/aux; its SUM over ranks is the mean
                share = float(aux.detach()) / scale
                logged["loss"] += share
                logged["router/aux"] = share
            for key, value in logged.items():
                sums[key] = sums.get(key, 0.0) + value
        _synchronize(self.runtime.device)
        self.timings = {"fwd_bwd_s": backward_done - started, "optimizer_s": time.perf_counter() - backward_done}
        return sums

    def eval_step(self, window: list[dict], answers: bool = True) -> tuple[dict[str, float], list[list[int]]]:
        """`recipes.training.engine.Engine.eval_step`: the wrapper's forward for the logged values (no gradient,
        no step), and with `answers` a second forward, the HF model's logits, for the teacher-forced answers
        (argmax over the vocabulary, across the AutoTP group where the head leaves the logits split)."""
        counts = step_counts(self.wrapper.counts, window, self.dp)
        module = self.engine.module
        training = module.training
        module.eval()
        sums: dict[str, float] = {}
        tokens: list[list[int]] = []
        try:
            with torch.no_grad():
                for inputs in window:
                    for key, value in self.engine(**inputs, loss_counts=counts).log_dict().items():
                        sums[key] = sums.get(key, 0.0) + value
                    if not answers:
                        continue
                    logits = self.model(**{k: v for k, v in inputs.items() if k != "labels"}).logits
                    split = logits.shape[-1] < self.hf_config.vocab_size
                    predicted = vocab_parallel_argmax(logits, group=_tensor_parallel_group() if split else None)
                    tokens += answer_tokens(predicted[:, :-1], inputs["labels"][:, 1:])  # logits at i: token i+1
        finally:
            module.train(training)
        return sums, tokens

    def eval_problem(self) -> str | None:
        """`recipes.training.engine.Engine.eval_problem`: every model this engine trains evaluates, except
        under sequence parallelism (each rank of a group would score the same rows)."""
        if self.ulysses is not None:
            return (f"deepspeed.sp_size {self.recipe.deepspeed.sp_size}: held-out evaluation under sequence "
                    "parallelism is not supported (evaluate the export with python -m recipes.evaluate)")
        return None

    def lr(self) -> float:
        """The rate the next update uses: the optimizer's own group lr, as the schedule set it."""
        return self.engine.get_lr()[0]

    def grad_norm(self) -> float | None:
        """DeepSpeed's global norm before clipping. At ZeRO stage 0 with a torch optimizer DeepSpeed keeps
        none (its fp32 clipping computes the norm and drops it): there, the norm this step measured
        before DeepSpeed's step (`_gradient_norm`)."""
        norm = self.engine.get_global_grad_norm()
        if norm is None:
            norm = self._own_norm
        return float(norm) if norm is not None else None

    def _gradient_norm(self) -> float:
        """The global gradient norm at the accumulation boundary (gradients reduced, not yet clipped), by
        DeepSpeed's own clipping routine with no clipping (max_norm inf: model-parallel parameters counted
        once, averaged over the data-parallel group). Collective: every rank calls it at each stage-0 step."""
        from deepspeed.runtime.utils import clip_grad_norm_

        params = [p for p in self.engine.module.parameters() if p.grad is not None]
        # Ulysses' groups object has no model-parallel group: its ranks hold whole, reduced gradients
        mpu = None if self.ulysses is not None else self.engine.mpu
        return float(clip_grad_norm_(params, max_norm=float("inf"), mpu=mpu)) if params else 0.0

    def weights_finite(self) -> bool:
        """This rank's parameters are finite: its ZeRO-3 partitions (`ds_tensor`), else the whole tensors."""
        return all(bool(torch.isfinite(getattr(p, "ds_tensor", p.data)).all()) for p in self.engine.module.parameters())

    def save_state(self, directory: Path, step: int) -> None:
        checkpoints.save_state(self.engine, directory, step, trainable_only=self.lora is not None)

    def load_state(self, directory: Path) -> None:
        """The checkpoint's model, optimizer and schedule state; then this recipe's optimizer hyperparameters
        and LR schedule at the loaded step (a resume may change them: `recipes.reliability.resume_policy`)."""
        checkpoints.load_state(self.engine, directory, self._load_tag, trainable_only=self.lora is not None)
        apply_recipe_schedule(self.scheduler, self.recipe)

    def export(self, path: Path, record: ExportRecord | None = None) -> None:
        """The Hugging Face model (merged, for LoRA with `model.lora.export_merged`) and for LoRA its adapter
        in `adapter/`, through the one export writer (`export.export_model`). Collective."""
        tokenizer = self.processor or self.tokenizer
        zero_stage = self.recipe.deepspeed.zero_stage
        merged = self.lora is None or self.lora.export_merged
        adapter = None
        if self.lora is not None:
            def adapter(staging: Path) -> None:
                save_adapter(self.peft_model, staging / "adapter", tokenizer, self.runtime.is_main, zero_stage)
        export_model(self.engine, self.model if merged else None, tokenizer, path, self.runtime,
                     zero_stage=zero_stage, tp_size=self.recipe.deepspeed.tp_size, record=record, extra=adapter)

    def close(self) -> None:
        """Destroy DeepSpeed's engine and drop this engine's model, wrapper and optimizer: DeepSpeed ties
        its process groups to them (the ZeRO optimizer, and every parameter's `_dp_group`), and a group
        that outlives the run is freed at interpreter exit, where it can abort the rank
        (`recipes.training.runtime.teardown`). The engine cannot be used afterwards."""
        import deepspeed.runtime.zero.parameter_offload as zero3_offload

        self.engine.destroy()
        # ZeRO-3 pushes the wrapped module onto a module-level stack and never pops it (DeepSpeed 0.19),
        # which would keep the model, and through its parameters the groups, until exit.
        stack = getattr(zero3_offload, "FWD_MODULE_STACK", [])
        stack[:] = [module for module in stack if module is not self.wrapper]
        # ZeRO-3's coordinator caches a method with `functools.lru_cache` on the class (DeepSpeed 0.19):
        # the cache holds every coordinator and, through its parameters, their groups.
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

        clear_method_caches([PartitionedParameterCoordinator])
        if self.ulysses is not None:
            self.ulysses.close()
        self.engine = self.wrapper = self.model = self.peft_model = self.scheduler = self.ulysses = None


def _tensor_parallel_group():
    from deepspeed.utils import groups

    return groups.get_tensor_model_parallel_group()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
