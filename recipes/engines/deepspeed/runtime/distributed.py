"""How a DeepSpeed rank starts: `import deepspeed` without what the recipes never use, and the process group
made or adopted through `deepspeed.comm` (its engine needs deepspeed.comm to know the group)."""

from __future__ import annotations

import os
import sys

import torch

from recipes.training.runtime import import_without

def skip_cpu_shm_op() -> None:
    """DeepSpeed's CPU accelerator compiles a shared-memory comm op at every first start (35-65 s, up to
    5 GB; it serves inference only). `deepspeed.comm.torch` looks it up as `build_shm_op`: return None."""
    import deepspeed.comm.torch  # noqa: F401  (binds the torch package name; the module is in sys.modules)

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def import_deepspeed():
    """`import deepspeed` without its autotuner's `import mlflow`: DeepSpeed imports mlflow at module load
    wherever it is installed (the `mlflow` extra; ~2 CPU s, a sixth of a rank's start-up) only to log
    autotuning experiments, which the recipes never run."""
    deepspeed = import_without("deepspeed", "mlflow")
    # ZeRO imports DeepSpeed's Muon in its optimizer check and its optimizers' constructors only to ask
    # `isinstance(optimizer, MuonWithAuxAdam)`; the module compiles its kernels at import (torch.compile
    # pulls in torch._inductor: ~4 of a DeepSpeed rank's ~12 CPU s of start-up, measured on a 1-rank tiny
    # run). The recipes build AdamW or DeepSpeed's Adam, never Muon, so a stand-in class answers instead.
    if MUON_MODULE not in sys.modules:
        sys.modules[MUON_MODULE] = _muon_stand_in()
    return deepspeed


def _muon_stand_in():
    import types

    module = types.ModuleType(MUON_MODULE, "numloss's stand-in: the recipes never build DeepSpeed's Muon")

    class MuonWithAuxAdam:  # no optimizer the recipes build is one
        def __init__(self, *args, **kwargs):
            raise RuntimeError("DeepSpeed's Muon is not available in a numloss recipe (the DeepSpeed engine stands "
                               "in for its module to skip compiling its kernels); the recipes train with AdamW or "
                               "DeepSpeed's Adam")

    module.MuonWithAuxAdam = MuonWithAuxAdam
    return module


def init_process_group(backend: str, timeout) -> None:
    """`recipes.training.runtime.setup_distributed`'s `init_group` for DeepSpeed: always through
    `deepspeed.init_distributed`, which adopts a group an orchestrator (Ray Train) already made (skipping
    it leaves deepspeed.comm believing in a world of one), else makes it with `backend` and `timeout`."""
    cpu = backend == "gloo"
    if cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    deepspeed = import_deepspeed()
    if cpu:
        skip_cpu_shm_op()
    if torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), dist_init_required=False)
    else:
        deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
    if deepspeed.comm.get_world_size() != torch.distributed.get_world_size():
        raise RuntimeError("deepspeed.comm did not adopt the torch.distributed process group")
