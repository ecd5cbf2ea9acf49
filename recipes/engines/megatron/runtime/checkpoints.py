"""The Megatron engine's state in `megatron.core.dist_checkpointing` form: it reshards, so a checkpoint
saved at one TP / PP / DP / EP layout loads at another (experts are keyed by their global number).

What is written, into `<directory>/megatron/` (the caller's step directory; the caller owns the step
directories, the `latest` marker and the data reader's per-rank state):
- the model: every chunk's `sharded_state_dict()` (keys are global: layer numbers across pipeline
  stages, full tensor shapes with this rank's offsets; TP-replicated tensors and the last stage's copy
  of tied embeddings are replicas, stored once);
- the CPU optimizer (`step.TorchAdamW`): exp_avg / exp_avg_sq, and for a bf16 model the fp32 main
  parameters (`main_param`), as ShardedTensors keyed and sharded exactly like their parameters
  (`optimizer.state.<name>.<param key>`, megatron-core's own helpers for torch optimizers), so they
  reshard as the parameters do; the step count (the same for every parameter), the param-group
  hyperparameters and the LR schedule are common values. On CUDA, megatron-core's optimizer gives its
  own `sharded_state_dict` (resharding too) and the schedules are common values;
- the RNG (torch CPU / CUDA and megatron's tracker states) as a ShardedObject per rank: restored when
  the layout is the one that saved it, left as seeded otherwise (a generator's state has no
  meaning on another rank), and the layout itself (`layout`, a common value).

Parallel contract: `save_state` and `load_state` are collectives over the whole world (every rank calls
them with the same directory, on a filesystem all ranks see); each rank writes and reads only its
shards (replicas: the main replica writes).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from recipes.reliability.checkpoint_writes import guarded_write
from recipes.reliability.preemption import SIGNALS
from recipes.training.runtime import die_with_parent

SUBDIR = "megatron"
MAIN = "main_param"  # the fp32 main parameter of a bf16 / fp16 model (`step.TorchAdamW`)


def _layout() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    # ep too: megatron's tracker holds an expert-parallel RNG seeded by the EP rank, which another EP
    # size places elsewhere (a checkpoint saved before ep was recorded compares unequal: RNG left as seeded)
    return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(), "ep": ps.get_expert_model_parallel_world_size()}


def _rng_state() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": get_cuda_rng_tracker().get_states()}


def _sharded_rng():
    """This rank's RNG as one element of a (pp, tp, dp)-shaped ShardedObject."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    shape = (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size(),
             ps.get_data_parallel_world_size())
    offset = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank())
    return ShardedObject("engine.rng", _rng_state(), shape, offset, replica_id=0)


def _model_sharded(model_chunks: list) -> dict:
    return {f"chunk{i}": chunk.module.sharded_state_dict() for i, chunk in enumerate(model_chunks)}


def _init_adamw_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter AdamW state (zeros, step 0) so that loading has tensors to load into."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not optimizer.state[p]:
                optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                      "exp_avg_sq": torch.zeros_like(p)}


def _adamw_sharded(opt, model_sharded: dict, loading: bool) -> dict:
    """`step.TorchAdamW`'s state as a sharded dict: moments like their parameters, the rest common."""
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    _init_adamw_state(opt.optimizer)  # before the first step too: zeros at step 0 update as a fresh AdamW
    state = opt.optimizer.state_dict()
    steps = {float(s["step"]) for s in state["state"].values()}
    if len(steps) > 1:
        raise ValueError(f"AdamW parameters at different step counts {sorted(steps)}: cannot save one step")
    # a model in bf16 is trained through fp32 main parameters: saved beside the moments, sharded as
    # the parameter, so a resume continues from them and not from their bf16 rounding
    state["state"] = {i: {**entry, **({MAIN: opt.main_params[i]} if opt.main_params[i] is not opt.params[i] else {})}
                      for i, entry in state["state"].items()}  # copies: the optimizer's own dicts stay as they are
    id_map = get_param_id_to_sharded_param_map(model_sharded, opt.params)
    optim_state_to_sharding_state(state, id_map, exclude_keys=("step",))
    return {"optimizer": state, "step": steps.pop() if steps else 0.0, "scheduler": opt.scheduler.state_dict()}


def _load_adamw(opt, loaded: dict) -> None:
    state = loaded["optimizer"]
    for i, param_state in state["state"].items():
        param_state["step"] = torch.tensor(float(loaded["step"]))
        if MAIN in param_state:
            opt.main_params[i].copy_(param_state.pop(MAIN))
    opt.optimizer.load_state_dict(state)
    opt.scheduler.load_state_dict(loaded["scheduler"])
    opt.copy_main_to_model()


def _optimizer_sharded(optimizer, model_sharded: dict, loading: bool) -> dict:
    if hasattr(optimizer, "schedulers"):  # step.MegatronAdam (CUDA)
        return {"optimizer": optimizer.optimizer.sharded_state_dict(model_sharded, is_loading=loading),
                "schedulers": [s.state_dict() for s in optimizer.schedulers]}
    return _adamw_sharded(optimizer, model_sharded, loading)


def _load_optimizer(optimizer, loaded: dict) -> None:
    """The saved optimizer state and schedule, then this run's recipe's hyperparameters and schedule at
    the saved step (a resume may change them: `recipes.reliability.resume_policy`)."""
    if hasattr(optimizer, "schedulers"):
        optimizer.optimizer.load_state_dict(loaded["optimizer"])
        for scheduler, state in zip(optimizer.schedulers, loaded["schedulers"]):
            scheduler.load_state_dict(state)
    else:
        _load_adamw(optimizer, loaded)
    optimizer.apply_recipe_schedule()


_WRITER_MANAGER = None  # the manager writer_queue_dies_with_rank started in this process


def writer_queue_dies_with_rank() -> None:
    """dist_checkpointing's file writers report to a queue served by a multiprocessing manager that the
    first save starts and keeps for the process's lifetime, in the rank's process group. Two faults
    follow, both fixed by making that queue first, from a manager whose server lives exactly as long as
    the rank (recipes.training.runtime.die_with_parent):
    - a preemption: torchrun forwards SIGTERM to each rank's process group, which ended the server, so
      the save the rank then makes on that request failed (broken pipe) in every process that had saved
      before; the server now ignores the rank's stop signals (recipes.reliability.preemption.SIGNALS);
    - a SIGKILLed rank: under a launcher that signals the rank alone (torchrun, a bare srun step; Ray
      kills the worker's process group) the server outlived it, hundreds of MB per rank, for good; the
      kernel now ends it with the rank.
    The kernel ties the server to the thread that starts it, so this runs in the thread that saves,
    before each save: a server gone with an earlier thread (a Ray worker's training thread) is started
    again."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    global _WRITER_MANAGER
    if not hasattr(filesystem_async, "_results_queue"):
        raise RuntimeError("megatron.core.dist_checkpointing.strategies.filesystem_async has no _results_queue: "
                           "this megatron-core makes its writers' queue another way; "
                           "recipes/engines/megatron/runtime/checkpoints.py writer_queue_dies_with_rank must follow it")
    queue = filesystem_async._results_queue
    if queue is not None and (_WRITER_MANAGER is None or _WRITER_MANAGER._process.is_alive()):
        return  # ours, serving; or megatron-core's own, made by a save before this call, which stays in use
    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))  # the context megatron-core uses
    manager.start(initializer=die_with_parent, initargs=(os.getpid(), SIGNALS))
    _WRITER_MANAGER = manager
    filesystem_async._results_queue = manager.Queue()


def save_state(directory: str | Path, model_chunks: list, optimizer) -> Path:
    """Write model, optimizer, LR schedule, RNG and layout into `<directory>/megatron` (see the module
    docstring). `model_chunks`: this rank's DDP-wrapped chunks. Returns that path. Collective."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import serialization

    path = Path(directory) / SUBDIR
    path.mkdir(parents=True, exist_ok=True)  # dist_checkpointing writes into an existing directory
    writer_queue_dies_with_rank()
    dist.barrier()
    model = _model_sharded(model_chunks)
    state = {"model": model, "optimizer": _optimizer_sharded(optimizer, model, loading=False),
             "rng": _sharded_rng(), "layout": _layout()}
    # its writes go through torch.save, and its writer processes' errors are raised on every rank by
    # dist_checkpointing itself; rank 0's metadata.json (before its last barrier) is held like them
    # (recipes.reliability.checkpoint_writes)
    with guarded_write(serialization, "save_config", "dist_checkpointing's metadata.json"):
        dist_checkpointing.save(state, str(path))
    return path


def load_state(directory: str | Path, model_chunks: list, optimizer) -> dict:
    """Read what `save_state` wrote, at this run's layout (resharded by dist_checkpointing) into the
    built model and optimizer; the RNG only when the saved layout is this one. Returns the saved
    layout. Collective."""
    from megatron.core import dist_checkpointing

    path = str(Path(directory) / SUBDIR)
    saved_layout = dist_checkpointing.load_common_state_dict(path)["layout"]
    same_layout = saved_layout == _layout()
    model = _model_sharded(model_chunks)
    request = {"model": model, "optimizer": _optimizer_sharded(optimizer, model, loading=True)}
    if same_layout:
        request["rng"] = _sharded_rng()
    loaded = dist_checkpointing.load(request, path)
    for i, chunk in enumerate(model_chunks):
        chunk.module.load_state_dict(loaded["model"][f"chunk{i}"], strict=True)
    _load_optimizer(optimizer, loaded["optimizer"])
    if same_layout:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        rng = loaded["rng"]
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        get_cuda_rng_tracker().set_states(rng["tracker"])
    return saved_layout
