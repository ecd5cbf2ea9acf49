"""recipes/engines/megatron/cpu_shim in one spawned rank: idempotent, leaves torch itself alone (only
megatron.core modules see the redirects), and megatron's own optimizer (Adam, fp32 grad-norm and clip,
which assert CUDA tensors unshimmed) steps a GPTModel under megatron's DDP with full recompute.
The multi-rank paths (TP, SP, 1F1B, interleaving, tied-embedding finalize, dist_checkpointing) are in
test_model.py."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.recipes.engines.megatron.helpers import VOCAB, recipe_for, run_ranks, save_tiny

if importlib.util.find_spec("megatron.core") is None:
    raise ImportError("tests/recipes/engines/megatron needs megatron-core (pip install -e '.[megatron]')")


def _one_rank(rank, world, model_dir):
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import schedules

    from recipes.engines.megatron.runtime import cpu_shim
    from recipes.engines.megatron.runtime.model import (
        build_model_chunks,
        initialize_model_parallel,
    )

    assert cpu_shim.apply() and cpu_shim.apply() and cpu_shim.is_applied()
    assert schedules.torch.zeros(2, device="cuda").device.type == "cpu"  # megatron's view
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(2, device="cuda")  # everyone else's torch is untouched
    recipe = recipe_for(model_dir)
    recipe.megatron.recompute = "full"
    initialize_model_parallel(recipe)
    (model,) = build_model_chunks(recipe)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=0.1,
                                                 use_distributed_optimizer=False), [ddp])
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ddp.zero_grad_buffer()
    opt.zero_grad()
    logits = ddp(ids, torch.arange(16)[None].expand(2, 16), None)
    torch.nn.functional.cross_entropy(logits[..., :VOCAB].reshape(-1, VOCAB), ids.roll(-1, 1).reshape(-1)).backward()
    ok, grad_norm, _ = opt.step()
    assert ok and grad_norm > 0.1  # the clip was live
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert len(moved) == len(before)
    parallel_state.destroy_model_parallel()


def test_shim_and_megatron_optimizer(tmp_path):
    run_ranks(1, _one_rank, save_tiny("llama", tmp_path / "llama"), timeout=240)
