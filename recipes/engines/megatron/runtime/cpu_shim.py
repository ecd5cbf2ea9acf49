"""megatron-core 0.16.1 on a machine without CUDA (CPU tensors, gloo): the redirects it needs.

megatron-core assumes a GPU in a few dozen places that have nothing GPU-specific about them: scalars
and buffers made with `device="cuda"` or `device=torch.cuda.current_device()`, `torch.cuda.synchronize`,
the "CUDA" RNG tracker that model-parallel dropout and recomputation fork, `Tensor.cuda()` on the
tied-embedding path, and an fp32 gradient clip that asserts `torch.cuda.FloatTensor`. None of them
changes the math: on CPU the "CUDA" device is the CPU and the "CUDA" RNG is the CPU default generator.

`apply()` does it; it is a no-op when `torch.cuda.is_available()` (a GPU run never sees this module's
effects) and idempotent (call it before building a model, as often as convenient). It never touches
the `torch` module itself: every loaded `megatron.core.*` module gets a stand-in for its global name
`torch` (`_CpuTorch`) that forwards everything to torch except the redirects below, so code outside
megatron-core (numloss, transformers, DeepSpeed) in the same process sees an untouched torch. Modules
of megatron-core imported after `apply()` are covered by calling it again (`build_gpt_model` does).

What it makes work on CPU/gloo (tested in tests/recipes/engines/megatron): GPTModel build/forward/backward (local
layer spec, TP/SP/PP), `get_forward_backward_func` (no pipelining, 1F1B, interleaved 1F1B), megatron's
`DistributedDataParallel` + `finalize_model_grads`, its fp32 grad-norm and clip, and
`dist_checkpointing` save/load. Not covered: CUDA graphs, Transformer Engine, overlapped grad reduce /
param gather (they need CUDA streams: keep `overlap_*` off on CPU), fp16 loss scaling, FSDP.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

_APPLIED_FLAG = "_numloss_cpu_shim"
# Modules whose `torch` must be redirected; imported by `apply()` so that they are covered even if the
# caller has not imported them yet. Other loaded megatron.core modules are redirected as well.
_MODULES = (
    "megatron.core.utils",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.tensor_parallel.data",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.module",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.models.common.language_module.language_module",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
)


def _is_cuda(device: Any) -> bool:
    """Whether a `device=` argument names a CUDA device ("cuda", "cuda:0", torch.device("cuda"), or an
    int, which torch reads as a CUDA ordinal)."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, torch.device) and device.type == "cuda"


def _on_cpu(factory: Callable) -> Callable:
    """A torch tensor factory whose CUDA `device=` becomes the CPU and whose `pin_memory=True` is
    dropped (pinning needs a CUDA driver). Why: megatron-core makes token counts (pipeline schedules),
    norms and overflow flags (optimizer, grad clip), causal masks (transformer.utils), grad buffers and
    checkpoint exchange buffers on `device="cuda"` or `torch.cuda.current_device()`."""

    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    return wrapper


class _NoNvtx(types.SimpleNamespace):
    """`torch.cuda.nvtx` stand-in: profiler ranges (megatron.core.utils.nvtx_range_push/pop when its
    nvtx switch is on) raise "NVTX functions not installed" on a CPU build; on CPU they mark nothing."""

    def range_push(self, msg: str) -> None:
        return None

    def range_pop(self) -> None:
        return None

    def mark(self, msg: str) -> None:
        return None


class _CpuCuda(types.ModuleType):
    """What megatron-core sees as `torch.cuda`: everything is torch.cuda's except the redirects."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")
        # `device=torch.cuda.current_device()` appears ~175 times (activation buffers, gathers in
        # tensor_parallel.mappings, rotary frequencies, p2p shape exchange): the CPU is the device.
        self.current_device = lambda: torch.device("cpu")
        # Host/device syncs before timing, freeing buffers and p2p: on CPU every op is already done.
        self.synchronize = lambda *args, **kwargs: None
        self.empty_cache = lambda: None
        # The "CUDA" RNG is the CPU default generator: the RNG tracker's `add` reads/seeds it to make
        # the model-parallel and data-parallel dropout states, and `model_parallel_cuda_manual_seed`
        # seeds it; recomputation (CheckpointFunction) saves and restores it.
        self.get_rng_state = lambda device="cuda": torch.get_rng_state()
        self.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
        self.manual_seed = torch.manual_seed
        self.manual_seed_all = torch.manual_seed
        self.nvtx = _NoNvtx()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _CpuTorch(types.ModuleType):
    """What a megatron-core module sees as its global `torch`: torch itself, except the tensor factories
    (CUDA device -> CPU, see `_on_cpu`) and `torch.cuda` (`_CpuCuda`). Attribute reads are forwarded,
    so `torch.Tensor`, `torch.distributed`, `torch.nn`, dtypes and isinstance checks are torch's."""

    def __init__(self) -> None:
        super().__init__("torch")
        for name in ("zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint",
                     "zeros_like", "ones_like", "empty_like", "full_like", "as_tensor"):
            setattr(self, name, _on_cpu(getattr(torch, name)))
        self.cuda = _CpuCuda()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


_CPU_TORCH = _CpuTorch()


@contextlib.contextmanager
def _tensor_cuda_is_identity():
    """Within the block, `Tensor.cuda()` returns the tensor itself (on a CUDA-less build it raises)."""
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def _with_tensor_cuda_identity(owner: Any, name: str) -> None:
    """Wrap `owner.name` (a function or method) in `_tensor_cuda_is_identity`, once."""
    fn = getattr(owner, name)
    if getattr(fn, _APPLIED_FLAG, False):
        return

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _tensor_cuda_is_identity():
            return fn(*args, **kwargs)

    setattr(wrapper, _APPLIED_FLAG, True)
    setattr(owner, name, wrapper)


def _get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """`tensor_parallel.random._get_cuda_rng_state` on CPU: the CPU default generator's state (a copy)."""
    return torch.get_rng_state()


def _set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    """`tensor_parallel.random._set_cuda_rng_state` on CPU: sets the CPU default generator's state."""
    torch.set_rng_state(new_state)


def _clip_grad_by_total_norm_fp32(parameters, max_norm: float, total_norm: float,
                                  use_decoupled_grad: bool = False) -> None:
    """`optimizer.clip_grads.clip_grad_by_total_norm_fp32` without its `torch.cuda.FloatTensor`
    assertion (fp32 CPU grads are `torch.FloatTensor`): scales every fp32 grad by
    max_norm / (total_norm + 1e-6) when that is below 1, in place, as megatron-core does."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = []
    for param in parameters:
        grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
        if grad is None:
            continue
        if grad.dtype != torch.float32 and not (use_decoupled_grad and grad.dtype == torch.bfloat16):
            raise TypeError(f"clip_grad_by_total_norm_fp32: expected fp32 grads, got {grad.dtype}")
        grads.append(grad.to_local() if hasattr(grad, "to_local") else grad)
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for g in grads:
            g.detach().mul_(clip_coeff)


def _redirect_module(module: types.ModuleType) -> None:
    if getattr(module, "torch", None) is torch:
        module.torch = _CPU_TORCH


def apply() -> bool:
    """Make megatron-core run on CPU/gloo (see the module docstring). Returns True when the redirects
    are in place, False on a machine with CUDA (nothing is changed there). Process-local: every rank
    calls it itself; idempotent; call again after importing more of megatron-core."""
    if torch.cuda.is_available():
        return False
    for name in _MODULES:
        importlib.import_module(name)
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and isinstance(module, types.ModuleType):
            _redirect_module(module)
    if getattr(sys.modules["megatron.core.tensor_parallel.random"], _APPLIED_FLAG, False):
        return True

    from megatron.core.models.common.language_module.language_module import (
        LanguageModule,
    )
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.tensor_parallel import random as mrandom

    # The RNG tracker (dropout inside TP regions, recomputation) forks the "CUDA" generator through
    # these two helpers, which index `torch.cuda.default_generators`: the CPU generator instead.
    mrandom._get_cuda_rng_state = _get_rng_state
    mrandom._set_cuda_rng_state = _set_rng_state
    # Tied embeddings with PP > 1: `setup_embeddings_and_output_layer` moves the shared weight with
    # `weight.data.cuda()` before all-reducing it between the first and last stage; on CPU it stays.
    _with_tensor_cuda_identity(LanguageModule, "setup_embeddings_and_output_layer")
    # The fp32 grad clip asserts `param.grad.type() == 'torch.cuda.FloatTensor'`; the norm itself
    # (get_grad_norm_fp32) runs as is through the factories above. Both names are rebound, since
    # optimizer.py imported the function by name.
    clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    setattr(mrandom, _APPLIED_FLAG, True)
    return True


def is_applied() -> bool:
    """Whether `apply()` has put the redirects in place in this process."""
    module = sys.modules.get("megatron.core.tensor_parallel.random")
    return bool(module is not None and getattr(module, _APPLIED_FLAG, False))
