"""One optimizer step of the Megatron-core engine, normalised over the whole global batch.

The same normalisation as the DeepSpeed engine (`recipes.training.parallel`): the step's micro-batches are counted from
their labels alone and one SUM all-reduce over the data-parallel group gives the step's counts before
the first forward; each micro-batch's loss is then its share of the global batch's loss
(`numloss.adapters.megatron.numeric_loss_func`, whose module docstring says how megatron-core's own
scaling with `calculate_per_token_loss=True` is undone). So both engines train on the gradient of the
same global-batch loss at any TP / PP / DP layout and micro-batch split.

Parallel contract of a step: every rank of the world calls `train_step` with its data-parallel
replica's window (the TP and PP ranks of one replica hold the same rows: the reader shards by
`parallel_state`'s data-parallel rank). Collectives: the count's all-reduce (DP group), the pipeline
schedule's p2p and the model's TP collectives, `finalize_model_grads` (DP grad reduce, TP-replicated
and tied-embedding grads, the token count), the grad norm's all-reduce (model-parallel group), and one
broadcast of the logged values from the last pipeline stage (PP group).

Mixture-of-experts models (`moe.py`): the routers' load-balancing loss `router/aux` joins the objective.
Its gradient is the mean over the step's micro-batches and data-parallel ranks of each micro-batch's
Σ_l aux_l (`moe.AuxLossScale`), it is logged as `router/aux` (the same mean) and added to `loss`; one
more all-reduce, over the model-parallel group (TP x PP: the layers of every stage, the TP shares of
sequence-parallel routers). The grad norm counts each expert's gradient once: experts differ over the
expert-parallel ranks, so their squares are summed over megatron's expert TP x EP x PP group.
"""

from __future__ import annotations

import math
import time
from functools import partial

import torch
import torch.distributed as dist

from numloss import LossCounts, Objective
from numloss.adapters.megatron import numeric_loss_func
from numloss.diagnostics import sum_keys
from recipes.config import Recipe
from recipes.training.held_out import answer_tokens, vocab_parallel_argmax
from recipes.training.parallel import DataParallel, step_counts
from recipes.training.schedule import apply_recipe_schedule, lr_lambda

from .batches import check_attention, prepare_window
from .moe import AuxLossScale, is_expert_param


def configure_schedule(config, model_chunks: list, overlap_grad_reduce: bool = False,
                       overlap_param_gather: bool = False) -> None:
    """Set what `get_forward_backward_func` reads from the model's TransformerConfig: per-token loss
    (no division by the micro-batch count; `finalize_model_grads` divides by the global token count),
    `finalize_model_grads` itself, and DDP's no-sync / overlap hooks (as Megatron-LM's training loop
    wires them). `calculate_per_token_loss` must already be set when DDP is built (DDP then sums
    gradients over the data-parallel group instead of averaging them)."""
    from megatron.core.distributed import finalize_model_grads

    if not config.calculate_per_token_loss:
        raise ValueError("build the model with calculate_per_token_loss=True before wrapping it in DDP")

    def one_or_list(name: str):
        fns = [getattr(chunk, name) for chunk in model_chunks]
        return fns[0] if len(fns) == 1 else fns

    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = one_or_list("no_sync")
    if overlap_grad_reduce:
        config.grad_sync_func = one_or_list("start_grad_sync")
    if overlap_param_gather:
        config.param_sync_func = one_or_list("start_param_sync")


def _params(model_chunks: list) -> list[torch.nn.Parameter]:
    return [p for chunk in model_chunks for p in chunk.parameters() if p.requires_grad]


def _param_names(model_chunks: list) -> list[str]:
    """The names of `_params(model_chunks)`, in the same order."""
    return [n for chunk in model_chunks for n, p in chunk.named_parameters() if p.requires_grad]


def global_grad_norm(params: list[torch.nn.Parameter], model_parallel_group,
                     grads: list[torch.Tensor] | None = None, expert_group=None,
                     names: list[str] | None = None) -> float:
    """The L2 norm of the whole model's gradient after `finalize_model_grads`: `grads[i]` is
    `params[i]`'s (default: `p.grad`; the CPU optimizer passes its fp32 main gradients).

    Parallel contract: gradients are identical over the data-parallel group by then, so only the
    model-parallel group (TP x PP) is summed over, once (one all-reduce of one float64). Each gradient
    element is counted once: a TP-sharded parameter by every TP rank (its shard), a TP-replicated one
    (norms, under SP too) by TP rank 0 only, and the last stage's copy of tied embeddings (`shared`)
    not at all (the first stage counts it). MoE experts (`names[i]` an expert's, given `expert_group`:
    megatron's expert TP x EP x PP group) differ over the expert-parallel ranks, which are data-parallel
    ranks: their squares are summed over `expert_group` instead (a second all-reduce)."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    device = params[0].device if params else None
    squares = torch.zeros((), dtype=torch.float64, device=device)
    expert_squares = torch.zeros((), dtype=torch.float64, device=device)
    experts = [expert_group is not None and is_expert_param(n) for n in (names or [""] * len(params))]
    for p, grad, expert in zip(params, [p.grad for p in params] if grads is None else grads, experts):
        if grad is not None and param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p):
            (expert_squares if expert else squares).add_(grad.detach().double().square().sum())
    dist.all_reduce(squares, group=model_parallel_group)
    if expert_group is not None:
        dist.all_reduce(expert_squares, group=expert_group)
    return float((squares + expert_squares).sqrt())


class TorchAdamW:
    """CPU: `torch.optim.AdamW` over the model chunks' parameters (every one decayed, as the DeepSpeed
    engine's AdamW), a LambdaLR with `recipes.training.schedule.lr_lambda`, the global grad norm and clipping
    done here (megatron-core's clip asserts CUDA tensors). Each rank updates its own parameters from
    gradients that `finalize_model_grads` left identical over the data-parallel group: no communication
    beyond the norm's.

    Mixed precision as on the GPU path (megatron-core's optimizer, DeepSpeed's bf16): a model in bf16 or
    fp16 is trained through fp32 main parameters (`main_params`), which AdamW updates from the fp32
    gradients DDP accumulated (`main_grad`) and which are rounded into the model after every step. Without
    them an update smaller than half a bf16 step of its weight (about 0.4% of the weight) is lost, and the
    moments are kept in bf16. In fp32 the main parameters are the model's own."""

    name = "torch.optim.AdamW (CPU)"

    def __init__(self, recipe: Recipe, model_chunks: list):
        from megatron.core import parallel_state

        o = recipe.optim
        self.model_chunks, self.params = model_chunks, _params(model_chunks)
        self.main_params = [p if p.dtype == torch.float32 else p.detach().float().clone() for p in self.params]
        self.grad_clip = o.grad_clip
        self.group = parallel_state.get_model_parallel_group()
        self.names = _param_names(model_chunks)
        moe = any(is_expert_param(n) for n in self.names)
        self.expert_group = parallel_state.get_expert_tensor_model_pipeline_parallel_group() if moe else None
        self.optimizer = torch.optim.AdamW(self.main_params, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                           weight_decay=o.weight_decay)
        self.recipe = recipe  # its schedule applies again after a checkpoint is loaded
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(recipe))

    def step(self) -> float:
        """Norm (before clipping), clip, update, advance the schedule; returns the norm."""
        for main, p in zip(self.main_params, self.params):
            main.grad = p.main_grad  # fp32 at any model dtype: the engine's DDP sets grad_reduce_in_fp32
        norm = global_grad_norm(self.params, self.group, [main.grad for main in self.main_params],
                                expert_group=self.expert_group, names=self.names)
        if self.grad_clip > 0 and norm > self.grad_clip:
            for main in self.main_params:
                main.grad.mul_(self.grad_clip / (norm + 1e-6))  # megatron-core's coefficient
        self.optimizer.step()
        self.scheduler.step()
        self.copy_main_to_model()
        return norm

    def copy_main_to_model(self) -> None:
        """Round the main parameters into the model's (after a step, and after a checkpoint is loaded)."""
        with torch.no_grad():
            for main, p in zip(self.main_params, self.params):
                if main is not p:
                    p.copy_(main)

    def zero_grad(self) -> None:
        for chunk in self.model_chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad(set_to_none=True)

    def lr(self) -> float:
        """The rate the next update uses: the optimizer's own, as the schedule set it."""
        return self.optimizer.param_groups[0]["lr"]

    def apply_recipe_schedule(self) -> None:
        """After a checkpoint is loaded: this recipe's hyperparameters and LR schedule at the loaded
        step count (`recipes.training.schedule.apply_recipe_schedule`); the moments stay loaded."""
        apply_recipe_schedule(self.scheduler, self.recipe)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}


class MegatronAdam:
    """CUDA: megatron-core's optimizer from `get_megatron_optimizer` (the DistributedOptimizer when
    `megatron.distributed_optimizer`; bf16 params with fp32 main params and grads), which computes the
    grad norm and clips itself; every parameter decayed (no per-name overrides, as the AdamW of the
    CPU path and of the DeepSpeed engine); the recipe's schedule as a LambdaLR on each torch optimizer
    inside it. Written from megatron-core 0.16.1's source; not run on this CPU-only machine."""

    def __init__(self, recipe: Recipe, model_chunks: list):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        o, m = recipe.optim, recipe.megatron
        config = OptimizerConfig(optimizer="adam", lr=o.lr, weight_decay=o.weight_decay, adam_beta1=o.betas[0],
                                 adam_beta2=o.betas[1], adam_eps=o.eps, clip_grad=o.grad_clip,
                                 bf16=recipe.model.dtype == "bfloat16", params_dtype=getattr(torch, recipe.model.dtype),
                                 use_distributed_optimizer=m.distributed_optimizer)
        self.model_chunks = model_chunks
        self.optimizer = get_megatron_optimizer(config, model_chunks, config_overrides={})
        self.name = f"megatron-core {'DistributedOptimizer' if m.distributed_optimizer else 'mixed-precision'} Adam"
        inner = [opt.optimizer for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer])]
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(recipe)) for opt in inner]
        self.recipe = recipe  # its schedule applies again after a checkpoint is loaded

    def step(self) -> float:
        ok, norm, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError("megatron-core's optimizer skipped the update (non-finite gradients)")
        for scheduler in self.schedulers:
            scheduler.step()
        return float(norm)

    def zero_grad(self) -> None:
        for chunk in self.model_chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    def lr(self) -> float:
        """The rate the next update uses: the first inner optimizer's own."""
        return self.schedulers[0].optimizer.param_groups[0]["lr"]

    def apply_recipe_schedule(self) -> None:
        """After a checkpoint is loaded: this recipe's hyperparameters and LR schedule, on every inner
        optimizer (`recipes.training.schedule.apply_recipe_schedule`). Not run here (CUDA only)."""
        for scheduler in self.schedulers:
            apply_recipe_schedule(scheduler, self.recipe)


def log_keys(objective: Objective, diagnostics: bool = False) -> list[str]:
    """The logged values' keys, as `ObjectiveOutput.log_dict()` names them (known on every stage), with
    the gradient sums of `numloss.diagnostics` when `diagnostics`."""
    keys = ["loss", "ce", "numeric_positions", *(f"term/{k}" for k in objective.config.terms)]
    return sorted(keys + (sum_keys(objective) if diagnostics else []))


ROUTER_AUX = "router/aux"


def train_step(model_chunks: list, optimizer, objective: Objective, window: list[dict], *,
               sequence_parallel: bool = False, real_vocab_size: int | None = None,
               diagnostics: bool = False, packing: str = "mask", te: bool = False,
               pad_multiple: int = 1, aux: AuxLossScale | None = None) -> dict[str, float]:
    """Forward, backward and update for this replica's micro-batches `window`, prepared in the model's
    `packing` ("mask" or "thd": `batches.py`; `te`: the model has the Transformer Engine spec, whose
    attention `batches.check_attention` guards). Each micro-batch runs at its own length, padded to a
    multiple of `pad_multiple` (the recipe's `data.pad_to_multiple_of`) and of TP under sequence
    parallelism (the two's least common multiple); with PP and lengths that differ within the step, the
    schedule exchanges each p2p tensor's shape first (megatron's `variable_seq_lengths`). Interleaved
    1F1B (several model chunks) runs the step's micro-batches at one length (`prepare_window`'s
    `one_length`: its shape exchange is not safe).
    `real_vocab_size`: the vocabulary before Megatron's padding, whose padded columns the objective
    leaves out (`numeric_loss_func`). `diagnostics`: the last stage also computes the gradient sums
    (`numloss.diagnostics`), logged and broadcast with the other values.

    Returns this rank's share of the logged values (`log_keys`, summed over the window; a SUM over the
    data-parallel group gives the global batch's), "tokens_run" (the token positions the replica ran,
    padding included: a SUM over data parallel gives the step's), "grad_norm" (the global norm before
    clipping, the same on every rank) and this rank's time split, "fwd_bwd_s" (the schedule: every
    micro-batch's forward and backward, with its p2p and gradient reduction) and "optimizer_s" (clip and
    update), each ended by a device synchronisation. Every rank returns the same keys: the last pipeline
    stage computes the values and broadcasts them over the pipeline group.

    `aux` (MoE models, `moe.install_aux_loss` done on every chunk): the routers' load-balancing loss
    joins the step (see the module docstring); "router/aux" is this rank's share of the step's value
    (a SUM over data parallel gives it) and is included in "loss"."""
    from megatron.core import parallel_state

    config = model_chunks[0].config
    if not config.calculate_per_token_loss or parallel_state.get_context_parallel_world_size() != 1:
        raise ValueError("the numloss step needs calculate_per_token_loss=True and no context parallelism")
    batches, dp, counts = _prepare_window(model_chunks, objective, window, sequence_parallel=sequence_parallel,
                                          packing=packing, te=te, pad_multiple=pad_multiple)
    if aux is not None:  # finalize_model_grads divides by the step's label count: what the loss_func returns
        aux.begin_step(len(batches), dp.size, float(counts.denominator(objective.denominator_keys()["ce"])))
    moe = {} if aux is None else {"padding_mask": None}

    def forward_step(data_iterator, model):
        m = next(data_iterator)
        if aux is not None:  # routers: padding is no token of the aux loss
            moe["padding_mask"] = _stage_padding_mask(model, m["padding_mask"], sequence_parallel)
        output = model(m["input_ids"], m["position_ids"], m["attention_mask"],  # last stage: [b, s, V/tp]
                       packed_seq_params=m.get("packed_seq_params"), **moe)
        return output, partial(numeric_loss_func, objective, counts, m["labels"],
                               sequence_ids=m.get("sequence_ids"), group="megatron", real_vocab_size=real_vocab_size,
                               diagnostics=diagnostics)

    started = time.perf_counter()
    reports = _run_schedule(model_chunks, batches, forward_step, forward_only=False)
    _synchronize()
    schedule_done = time.perf_counter()
    grad_norm = optimizer.step()
    optimizer.zero_grad()
    _synchronize()
    timings = {"fwd_bwd_s": schedule_done - started, "optimizer_s": time.perf_counter() - schedule_done}

    keys = log_keys(objective, diagnostics)
    values = torch.zeros(len(keys), dtype=torch.float64)
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        for report in reports:
            values += torch.tensor([float(report[k]) for k in keys], dtype=torch.float64)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        device = next(iter(model_chunks[0].parameters())).device  # NCCL needs a device tensor
        values = values.to(device)
        dist.broadcast(values, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                       group=parallel_state.get_pipeline_model_parallel_group())
    result = dict(zip(keys, values.tolist()))
    if aux is not None:
        # every stage's layers, every TP rank's share (SP); this replica's micro-batches' mean over DP
        share = torch.tensor(aux.local_sum() / (len(batches) * dp.size), dtype=torch.float64,
                             device=values.device)
        dist.all_reduce(share, group=parallel_state.get_model_parallel_group())
        result[ROUTER_AUX] = float(share)
        result["loss"] += float(share)
    return {**result, "tokens_run": float(sum(m["tokens_run"] for m in batches)),
            "grad_norm": grad_norm, **timings}


def eval_step(model_chunks: list, objective: Objective, window: list[dict], *, sequence_parallel: bool = False,
              real_vocab_size: int | None = None, packing: str = "mask", te: bool = False,
              pad_multiple: int = 1, answers: bool = True) -> tuple[dict[str, float], list[list[int]]]:
    """The forward of `train_step` only (megatron's schedule with forward_only: no gradient, no update) over
    this replica's `window`: this rank's share of the logged values (`log_keys`, normalised over the window's
    global counts, summed over its micro-batches) and, per row in order, the teacher-forced answer: the argmax
    of the vocabulary-parallel logits (padded columns left out) at each label position (with `answers`
    False none: []). The last pipeline stage computes both and sends them over the pipeline group, so every
    rank returns the same."""
    from megatron.core import parallel_state

    ignore = objective.config.ignore_index
    batches, _, counts = _prepare_window(model_chunks, objective, window, sequence_parallel=sequence_parallel,
                                         packing=packing, te=te, pad_multiple=pad_multiple)
    tp_group = parallel_state.get_tensor_model_parallel_group()

    def loss_and_answers(labels, sequence_ids, logits):
        predicted = (vocab_parallel_argmax(logits.detach(), group=tp_group, real_vocab_size=real_vocab_size)
                     if answers else None)
        loss, n, report = numeric_loss_func(objective, counts, labels, logits, sequence_ids=sequence_ids,
                                            group="megatron", real_vocab_size=real_vocab_size)
        return loss, n, {**report, "answers": answer_tokens(predicted, labels, ignore) if answers else []}

    def forward_step(data_iterator, model):
        m = next(data_iterator)
        output = model(m["input_ids"], m["position_ids"], m["attention_mask"],
                       packed_seq_params=m.get("packed_seq_params"))
        return output, partial(loss_and_answers, m["labels"], m.get("sequence_ids"))

    reports = _run_schedule(model_chunks, batches, forward_step, forward_only=True)
    keys = log_keys(objective)
    payload = [None]
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        values = {k: sum(float(r[k]) for r in reports) for k in keys}
        payload = [(values, [row for r in reports for row in r["answers"]])]
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast_object_list(payload, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                   group=parallel_state.get_pipeline_model_parallel_group())
    return payload[0]


def _prepare_window(model_chunks: list, objective: Objective, window: list[dict], *, sequence_parallel: bool,
                    packing: str, te: bool, pad_multiple: int) -> tuple[list[dict], DataParallel, LossCounts]:
    """This replica's `window` as the schedule takes it, the same for a training and an evaluation forward:
    each micro-batch in the model's `packing` at its own length (one length under interleaving), padded to
    a multiple of `pad_multiple` and of TP under sequence parallelism, and to the EP group's longest
    micro-batch under expert parallelism (`_same_lengths_over_ep`); its attention checked against the
    layer spec (`te`). Returns the micro-batches, the data-parallel group and the window's global counts
    (`step_counts`: one SUM all-reduce over it, as the DeepSpeed engine counts a step)."""
    from megatron.core import parallel_state

    ignore = objective.config.ignore_index
    multiple = math.lcm(pad_multiple, parallel_state.get_tensor_model_parallel_world_size() if sequence_parallel else 1)
    batches = prepare_window(window, pad_multiple=multiple, ignore_index=ignore, packing=packing,
                             one_length=len(model_chunks) > 1)
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        batches = _same_lengths_over_ep(window, batches, multiple, ignore, packing)
    for m in batches:
        check_attention(m, te, packing)
    dp = DataParallel(parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size(),
                      parallel_state.get_data_parallel_group())
    return batches, dp, step_counts(objective.counts, batches, dp)


def _run_schedule(model_chunks: list, batches: list[dict], forward_step, forward_only: bool) -> list:
    """megatron's pipeline schedule over the prepared `batches` (`forward_only`: no backward); returns the
    loss function's reports, one per micro-batch, on the last pipeline stage."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    shapes = {tuple(m["input_ids"].shape) for m in batches}
    if len({b for b, _ in shapes}) > 1:
        raise ValueError("every micro-batch of a step must have the same number of rows")
    b, s = batches[0]["input_ids"].shape[0], max(length for _, length in shapes)
    for chunk in model_chunks:  # read by the schedule's p2p: exchange shapes only when they differ
        chunk.config.variable_seq_lengths = len(shapes) > 1
    # Interleaved 1F1B: one iterator per model chunk, each walking the whole window.
    iterators = [iter(batches) for _ in model_chunks]
    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iterators if len(iterators) > 1 else iterators[0],
        model=model_chunks, num_microbatches=len(batches), seq_length=s, micro_batch_size=b,
        forward_only=forward_only)


def _same_lengths_over_ep(window: list[dict], batches: list[dict], pad_multiple: int, ignore_index: int,
                          packing: str) -> list[dict]:
    """Under expert parallelism the EP ranks (data-parallel ranks with different rows) exchange tokens
    micro-batch by micro-batch; megatron's allgather dispatcher gathers equal-sized blocks, so micro-batch
    i is padded to the longest micro-batch i of the EP group (one MAX all-reduce of the lengths). The
    padding is masked out of attention, the loss and the router loss."""
    from megatron.core import parallel_state

    from .batches import mask_micro_batch, thd_micro_batch

    lengths = torch.tensor([m["input_ids"].shape[1] for m in batches], dtype=torch.int64)
    device = batches[0]["input_ids"].device
    lengths = lengths.to(device)
    dist.all_reduce(lengths, op=dist.ReduceOp.MAX, group=parallel_state.get_expert_model_parallel_group())
    prepare = thd_micro_batch if packing == "thd" else mask_micro_batch
    return [m if m["input_ids"].shape[1] == int(n) else prepare(w, pad_multiple, ignore_index, length=int(n))
            for w, m, n in zip(window, batches, lengths.tolist())]


def _stage_padding_mask(model, padding_mask: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """The `[b, s]` padding mask as this model chunk's GPTModel needs it: megatron-core 0.16.1 cuts it to
    this TP rank's sequence slice under SP only on the chunk with the embedding; a later pipeline chunk
    would hand its routers the whole mask against their slice of tokens, so it is cut here."""
    from megatron.core import parallel_state

    inner = model
    while hasattr(inner, "module") and not hasattr(inner, "pre_process"):
        inner = inner.module
    if not sequence_parallel or getattr(inner, "pre_process", True):
        return padding_mask
    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    step = padding_mask.shape[1] // tp
    return padding_mask[:, rank * step:(rank + 1) * step]


def _synchronize() -> None:
    """Wait for this rank's queued GPU work, so that a time split measures the work (no-op on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
