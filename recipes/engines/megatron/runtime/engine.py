"""`MegatronEngine`: the recipe's backbone as megatron-core GPTModel chunks under TP / PP (interleaved
when `megatron.virtual_pp_size`) / SP / DP, trained with numloss's objective normalised over the whole
global batch. The shared training loop drives it (the DeepSpeed engine has the same interface):

    engine = MegatronEngine(recipe, runtime)   # collective: every rank of the world
    reader shards rows by engine.dp.rank / engine.dp.size
    row = engine.train_step(window)             # this rank's share of the logged values + grad_norm
    engine.lr(); engine.save_state(d); engine.load_state(d); engine.export(path, record); engine.close()

Ranks are ordered TP fastest, then DP, then PP (`MegatronSection`); the TP and PP ranks of one
data-parallel replica read the same rows. Devices: CUDA uses megatron-core's optimizer (DistributedOptimizer
per the recipe), overlapped grad reduce / param gather, and where Transformer Engine imports its layer
spec, fused kernels and THD packing (`kernels.py` decides; the run log names what is on); CPU (gloo,
`cpu_shim`) uses megatron's local spec, torch AdamW with the grad norm and clip computed in `step.py`,
and no overlap (it needs CUDA streams).

Mixture-of-experts backbones (Qwen3-MoE, Mixtral: `moe.py`) add expert parallelism (`megatron.ep_size`,
inside the data-parallel size), megatron's dropless token dispatcher (`megatron.moe_token_dispatcher`)
and the routers' load-balancing loss, added to the objective and logged as `router/aux` (`step.py`).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from numloss import NumericVocab, Objective
from recipes.config import Recipe
from recipes.inputs.tokenizer import load_tokenizer
from recipes.reliability.checkpoints import CheckpointDirs
from recipes.reliability.export_writer import ExportRecord
from recipes.training.parallel import DataParallel
from recipes.training.runtime import Runtime, import_without, setup_distributed

from . import checkpoints, step
from ..pure.contract import checkpoint_layout
from .converted import load_converted
from ..pure.kernels import KernelPlan, plan_kernels
from .moe import AuxLossScale, install_aux_loss
from .model import build_model_chunks, initialize_model_parallel, release_model_parallel


class MegatronEngine:
    """`recipes.training.engine.Engine` on megatron-core; see the module docstring."""

    name = "megatron"
    # a plain torch.distributed group; megatron-core makes its own groups inside it
    join_process_group = staticmethod(setup_distributed)
    processor = None  # text models only (Recipe.validate refuses model.vision on this engine)

    def __init__(self, recipe: Recipe, runtime: Runtime, dirs: CheckpointDirs | None = None,
                 kernels: KernelPlan | None = None):
        """Parallel state, model chunks, numeric vocabulary (at the padded vocab size), objective, DDP
        and optimizer. Collective over the world (group set-up; tied embeddings at PP > 1; `dirs`'s
        checkpoint verification).

        Where the weights come from, decided here and named in the run log: a run that will resume
        (`dirs` holds a checkpoint to resume from; every layout loads every checkpoint, the format
        reshards) builds its model uninitialised and reads no HF weight (`recipes.train` loads the
        checkpoint next); else `megatron.load_converted` (a `recipes.convert` output, loaded here at
        this layout); else the HF checkpoint, each rank converting its share. `kernels`: the layer spec
        and fusions (default `kernels.plan_kernels(recipe.megatron)`; the CPU tests pass their own)."""
        # megatron-core imports wandb at load (its inference context and timers log to it) wherever it is
        # installed: ~0.8 CPU s of every rank's start for logging the recipes do through their own trackers
        import_without("megatron.core", "wandb")
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
        )

        if recipe.loss.head != "logits":
            raise NotImplementedError("the Megatron engine computes the objective on GPTModel's vocab-parallel"
                                      " logits: loss.head must be 'logits'")
        self.recipe, self.runtime = recipe, runtime
        m = recipe.megatron
        initialize_model_parallel(recipe)
        self.dp = DataParallel(ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(),
                               ps.get_data_parallel_group())
        self.layout = checkpoint_layout(m, self.dp.size)
        self.tokenizer, _ = load_tokenizer(recipe)
        # rows as the reader made them ([b, s] masks, packed rows' segment ids): batches.prepare_window
        # builds what the layer spec takes (a block mask, or THD sequences)
        self.batch_options = {"attn_implementation": "segments", "pad_to_multiple_of": recipe.data.pad_to_multiple_of,
                              "max_length": recipe.data.seq_len}
        self._grad_norm: float | None = None
        cuda = torch.cuda.is_available()
        self.kernels = kernels if kernels is not None else plan_kernels(m, cuda=cuda)
        resuming = dirs is not None and dirs.resume_tag() is not None
        converted = None if resuming else m.load_converted
        self.weights_from = ("the run's checkpoint" if resuming else f"converted {converted}" if converted
                             else "random init" if recipe.model.name_or_path is None
                             else f"HF {recipe.model.name_or_path}")
        chunks = build_model_chunks(recipe, self.kernels, read_hf_weights=not (resuming or converted))
        if converted:
            load_converted(converted, chunks)  # before DDP and the optimizer copy the weights
        if runtime.is_main:
            print(f"[numloss] megatron: {self.kernels.describe()}; weights from {self.weights_from}", flush=True)
        for chunk in chunks:  # (build_gpt_model marks TP-split weights and turns batched p2p off on gloo)
            # Before DDP: with it DDP sums gradients over DP and the schedules keep per-micro-batch sums.
            chunk.config.calculate_per_token_loss = True
            if cuda:
                chunk.cuda(torch.cuda.current_device())
        # MoE: every router attaches its load-balancing loss through one step-wide scale (moe.AuxLossScale)
        self.aux = AuxLossScale() if chunks[0].config.num_moe_experts else None
        if self.aux is not None:
            for chunk in chunks:
                install_aux_loss(chunk, self.aux)
            if runtime.is_main:
                print(f"[numloss] megatron MoE: {chunks[0].config.num_moe_experts} experts, top-"
                      f"{chunks[0].config.moe_router_topk}, EP {m.ep_size}, dispatcher "
                      f"{chunks[0].config.moe_token_dispatcher_type}, router/aux coeff "
                      f"{chunks[0].config.moe_aux_loss_coeff}, dropless", flush=True)
        padded = chunks[0].vocab_size
        # The HF model's logits width: Megatron's padding past it stays out of the loss, so both engines
        # and every TP size (which pad differently) train on the same softmax.
        self.real_vocab_size = chunks[0].hf_config.vocab_size
        self.hf_config = chunks[0].hf_config  # recipes.training.throughput: FLOPs per token
        if len(self.tokenizer) > padded:
            raise ValueError(f"tokenizer has {len(self.tokenizer)} tokens but the model's vocabulary only {padded}")
        vocab = NumericVocab.from_tokenizer(self.tokenizer, policy=recipe.loss.numeric_policy,
                                            max_value=recipe.loss.numeric_max_value,
                                            space_variants=recipe.loss.space_variants, vocab_size=padded)
        self.objective = Objective(vocab, recipe.loss.objective)
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, average_in_collective=False,
                                                   **self.kernels.ddp)
        # Bucketing only for the first chunk, as Megatron-LM does (later chunks' grads reduce as one).
        self.model = [DistributedDataParallel(chunk.config, ddp_config, chunk, disable_bucketing=i > 0)
                      for i, chunk in enumerate(chunks)]
        step.configure_schedule(chunks[0].config, self.model, ddp_config.overlap_grad_reduce,
                                ddp_config.overlap_param_gather)
        self.optimizer = step.MegatronAdam(recipe, self.model) if cuda else step.TorchAdamW(recipe, self.model)
        self.optimizer_name = self.optimizer.name

    def train_step(self, window: list[dict], diagnostics: bool = False) -> dict[str, float]:
        """One optimizer step over this replica's micro-batches (dicts of `[b, s]` tensors: input_ids,
        labels unshifted with -100, attention_mask, optional position_ids / sequence_ids). Returns
        this rank's share of loss, ce, term/*, numeric_positions (and with `diagnostics` the gradient
        sums grad_sums/*; sum them over `dp.group`), tokens_run (the positions this replica ran, padding
        included: `recipes.train`'s padding_ratio) and the global grad_norm before clipping.
        Collective over the world."""
        for chunk in self.model:
            chunk.train()
        sums = step.train_step(self.model, self.optimizer, self.objective, window,
                               sequence_parallel=self.recipe.megatron.sequence_parallel,
                               real_vocab_size=self.real_vocab_size, diagnostics=diagnostics,
                               packing=self.kernels.packing, te=self.kernels.te,
                               pad_multiple=self.recipe.data.pad_to_multiple_of, aux=self.aux)
        self._grad_norm = sums.pop("grad_norm")  # already global: not a value to sum over data parallel
        self.timings = {key: sums.pop(key) for key in ("fwd_bwd_s", "optimizer_s")}  # recipes.training.throughput
        return sums

    def eval_step(self, window: list[dict], answers: bool = True) -> tuple[dict[str, float], list[list[int]]]:
        """`recipes.training.engine.Engine.eval_step` (`step.eval_step`): in eval mode, the training mode
        restored after; refused where `eval_problem` says why."""
        problem = self.eval_problem()
        if problem is not None:
            raise ValueError(problem)
        for chunk in self.model:
            chunk.eval()
        try:
            return step.eval_step(self.model, self.objective, window,
                                  sequence_parallel=self.recipe.megatron.sequence_parallel,
                                  real_vocab_size=self.real_vocab_size, packing=self.kernels.packing,
                                  te=self.kernels.te, pad_multiple=self.recipe.data.pad_to_multiple_of,
                                  answers=answers)
        finally:
            for chunk in self.model:
                chunk.train()

    def eval_problem(self) -> str | None:
        """`recipes.training.engine.Engine.eval_problem`: a mixture-of-experts model has no forward outside a
        training step: its routers' aux loss counts each step's micro-batches (`moe.AuxLossScale`), which such
        a forward would disturb."""
        if self.aux is not None:
            return ("a Megatron mixture-of-experts model has no forward outside a training step yet (its router "
                    "aux loss is counted per training step)")
        return None

    def grad_norm(self) -> float | None:
        """The last step's global gradient norm before clipping (every rank holds the same)."""
        return self._grad_norm

    def lr(self) -> float:
        """The learning rate the next step uses."""
        return self.optimizer.lr()

    @contextlib.contextmanager
    def _gathered_params(self):
        """With overlapped param gather (CUDA, distributed optimizer) the last step's updated params
        are all-gathered only by the next forward's pre-hooks: gather them now (as Megatron-LM does
        before saving) for the duration of the block. Nothing to do otherwise."""
        overlapped = [chunk for chunk in self.model if chunk.ddp_config.overlap_param_gather]
        for chunk in overlapped:
            chunk.disable_forward_pre_hook(param_sync=True)
        try:
            yield
        finally:
            for chunk in overlapped:
                chunk.enable_forward_pre_hook()

    def weights_finite(self) -> bool:
        """This rank's parameters (its TP / PP shards) are all finite (`recipes.reliability.health`)."""
        return all(bool(torch.isfinite(p).all()) for chunk in self.model for p in chunk.parameters())

    def save_state(self, directory: Path, step: int) -> None:
        """Model, optimizer, schedule and RNG into `directory` (`checkpoints.save_state`). Collective."""
        with self._gathered_params():
            checkpoints.save_state(directory, self.model, self.optimizer)

    def load_state(self, directory: Path) -> None:
        """Restore what `save_state` wrote, from any TP / PP / DP layout. Collective."""
        checkpoints.load_state(directory, self.model, self.optimizer)

    def export(self, path: Path, record: ExportRecord | None = None) -> None:
        """A Hugging Face safetensors model with its tokenizer in `path` (`export.export_hf`: DP rank 0's
        copy, one writer per pipeline stage, through the one export writer). Collective."""
        from .export import export_hf

        with self._gathered_params():
            export_hf(self.model, path, tokenizer=self.tokenizer, record=record)

    def close(self) -> None:
        """Destroy megatron's model-parallel state and drop the model and optimizer, which hold its groups
        (`recipes.training.runtime.teardown`). The default process group stays: the loop owns it. The
        engine cannot be used afterwards."""
        release_model_parallel(self.model)
        self.model = self.optimizer = None
