"""Which transformer implementation (megatron-core layer spec) and which fused kernels the Megatron engine
runs, decided in one place from what imports on this machine: `plan_kernels`.

On CUDA with Transformer Engine (`te_missing`: TE itself imports, and megatron-core's TE extension found it:
its `HAVE_TE`; the extension module alone imports fine without TE, with TE's names left undefined), the run is
what Megatron-LM runs:
- the TE layer spec (`get_gpt_layer_with_transformer_engine_spec`): TE linear layers with the RMSNorms fused
  into `linear_qkv` / `linear_fc1` (`layer_norm_weight`), TE's fused attention, `TENorm` as the final norm;
- `apply_rope_fusion` (TE's fused RoPE, also its THD variant), `bias_activation_fusion` (megatron's fused
  SwiGLU, a `torch.compile`d kernel with its own backward), `bias_dropout_fusion` (megatron's fused
  bias-dropout-add);
- `gradient_accumulation_fusion` when apex's `fused_weight_gradient_mlp_cuda` imports as well: each
  linear layer's weight gradient is accumulated into the fp32 `main_grad` by the GEMM itself instead of
  a bf16 gradient followed by an add (TE does it in its own layers; the output layer is megatron's
  `ColumnParallelLinear`, which needs apex's kernel and refuses the flag without it);
- packed rows as THD (`packing == "thd"`: `batches.thd_micro_batch`, cu_seqlens in megatron's
  `PackedSeqParams`): TE's attention ignores a dense mask under the spec's causal mask type, so a
  block mask would let packed examples attend to each other silently (`batches.check_attention` refuses it);
- the distributed optimizer's `overlap_grad_reduce` / `overlap_param_gather` as the recipe asks.

Left off on purpose, everywhere: `masked_softmax_fusion` (TE's attention computes its own softmax; the
local spec's fused kernel, like TE, drops a dense mask under a causal mask type, and the local spec is the
one that takes the block mask) and `persist_layer_norm` (apex's persistent LayerNorm kernel: these models
use RMSNorm, which it does not implement; TE's norms are fused into the linears).

Without CUDA (the CPU tests) or without TE: megatron's local spec with `model.RMSNorm`, packed rows as a
block mask; on CUDA without TE the megatron-only fusions (SwiGLU, bias-dropout-add) and, with apex, the
gradient-accumulation fusion still apply. On CPU every fusion is off: megatron's fused kernels are
`torch.compile`d functions, which on a CPU compile C++ at their first call for nothing to gain.

`megatron.transformer_impl` forces a spec (`local`, or `transformer_engine`, refused before any model is
built where TE cannot run, naming what to install) the way Megatron-LM's `--transformer-impl` does; `auto`
(default) decides as above and the run log says which spec it took and why (`KernelPlan.describe`). Pure: no
communication, no torch (the caller says whether there is CUDA); the same on every rank of a homogeneous
cluster. The TE probe imports TE and megatron-core (heavy, optional: inside the functions).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

TE_SPEC, LOCAL_SPEC = "transformer_engine", "local"
TRANSFORMER_IMPLS = ("auto", TE_SPEC, LOCAL_SPEC)
# What a flag needs to import beyond CUDA. TE is TE's own PyTorch package; megatron-core's extension module
# imports without it (HAVE_TE False), so its import alone says nothing.
TE_PACKAGE = "transformer_engine.pytorch"
TE_MODULE = "megatron.core.extensions.transformer_engine"
TE_INSTALL = ("pip install --no-build-isolation 'transformer_engine[pytorch]' (or an NGC PyTorch image, which "
              "ships it)")
APEX_GRAD_ACCUM_MODULE = "fused_weight_gradient_mlp_cuda"
# TransformerConfig's fusion fields this engine sets (every one, on or off).
FUSION_FLAGS = ("gradient_accumulation_fusion", "bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion",
                "masked_softmax_fusion", "persist_layer_norm", "cross_entropy_loss_fusion")
NO_FUSIONS = {name: False for name in FUSION_FLAGS}


def import_error(module: str) -> str | None:
    """Why `module` does not import here (its error, one line), or None when it does. A broken install (an
    ImportError inside it, a missing shared library, a CUDA mismatch raised at import) counts as absent."""
    try:
        importlib.import_module(module)
    except Exception as err:  # noqa: BLE001  (any failure to import is "not here", with its reason kept)
        return f"{type(err).__name__}: {err}".splitlines()[0][:200]
    return None


def importable(module: str) -> bool:
    return import_error(module) is None


def te_missing(can_import: Callable[[str], bool] | None = None) -> str | None:
    """Why the Transformer Engine spec cannot be built here, or None when it can: TE's PyTorch package must
    import, and megatron-core's TE extension must have found it (`HAVE_TE`), since the spec's classes are
    defined only then. `can_import` (None: the real probe) is the seam the tests use to ask "as if"; the
    extension's flag is read by the real probe only."""
    if can_import is not None:
        for module in (TE_PACKAGE, TE_MODULE):
            if not can_import(module):
                return f"{module} does not import"
        return None
    for module in (TE_PACKAGE, TE_MODULE):
        if (error := import_error(module)) is not None:
            return f"{module} does not import ({error})"
    if not getattr(importlib.import_module(TE_MODULE), "HAVE_TE", False):
        return f"{TE_MODULE} imports but found no Transformer Engine (its HAVE_TE is False)"
    return None


def te_available() -> bool:
    """Whether Transformer Engine can run here (the real probe: `te_missing`)."""
    return te_missing() is None


@dataclass(frozen=True)
class KernelPlan:
    """The spec, the TransformerConfig fusion flags, DDP's overlap flags and the packing of one run."""

    spec: str  # TE_SPEC | LOCAL_SPEC
    fusions: dict[str, bool]  # TransformerConfig fields: every name of FUSION_FLAGS
    ddp: dict[str, bool]  # DistributedDataParallelConfig fields: use_distributed_optimizer, overlap_*
    packing: str  # "thd" (TE: cu_seqlens) | "mask" (local spec: a [b, 1, s, s] block mask)
    why_off: dict[str, str] = field(default_factory=dict)  # flag -> why it is off (for the run log)
    why_spec: str = ""  # why this spec (for the run log): the recipe asked, or what the probe found
    # the local spec's core attention (None: megatron's DotProductAttention). A seam for the CPU tests,
    # which run the THD path through a plain-torch variable-length attention in place of TE's kernel.
    core_attention: type | None = None

    @property
    def te(self) -> bool:
        return self.spec == TE_SPEC

    def describe(self) -> str:
        """One line for the run log: the spec, the flags on, the off ones grouped by why, the packing."""
        flags = {**self.fusions, **self.ddp}
        on = [name for name, value in flags.items() if value]
        off: dict[str, list[str]] = {}
        for name, value in flags.items():
            if not value:
                off.setdefault(self.why_off.get(name, "off"), []).append(name)
        why = f" ({self.why_spec})" if self.why_spec else ""
        return (f"layer spec {self.spec}{why}; on: {', '.join(on) or 'none'}; off: "
                + "; ".join(f"{', '.join(names)} ({why})" for why, names in off.items())
                + f"; packed rows: {'THD (cu_seqlens)' if self.packing == 'thd' else 'block mask'}")


def plan_kernels(megatron, *, cuda: bool, can_import: Callable[[str], bool] | None = None) -> KernelPlan:
    """The spec and flags for a `MegatronSection` (see the module docstring). `cuda` (whether the run's
    devices are GPUs: the engine passes torch's answer) and `can_import` (default: `importable`) are what
    the decision reads (None: the real probe, `te_missing` and `importable`), so a test can ask it "as if TE
    were present". Raises ValueError for
    `transformer_impl: transformer_engine` where TE cannot run."""
    impl = getattr(megatron, "transformer_impl", "auto")
    if impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"megatron.transformer_impl: {impl!r} is not one of {list(TRANSFORMER_IMPLS)}")
    no_te = "no GPU" if not cuda else None if impl == LOCAL_SPEC else te_missing(can_import)
    if impl == TE_SPEC and no_te:
        raise ValueError(f"megatron.transformer_impl: transformer_engine needs CUDA and Transformer Engine ({no_te})"
                         + ("; install it: " + TE_INSTALL if cuda else "") + "; or set megatron.transformer_impl "
                         "to auto or local")
    te = no_te is None and impl != LOCAL_SPEC
    why_spec = (f"megatron.transformer_impl: {impl}" if impl != "auto"
                else "auto: Transformer Engine on CUDA" if te else f"auto: {no_te}")
    why: dict[str, str] = {}
    fusions = dict(NO_FUSIONS)
    if not cuda:
        for name in ("gradient_accumulation_fusion", "bias_activation_fusion", "bias_dropout_fusion",
                     "apply_rope_fusion"):
            why[name] = "no CUDA"
    else:
        fusions["bias_activation_fusion"] = fusions["bias_dropout_fusion"] = True
        fusions["apply_rope_fusion"] = te
        if not te:
            why["apply_rope_fusion"] = "needs Transformer Engine"
        fusions["gradient_accumulation_fusion"] = (can_import or importable)(APEX_GRAD_ACCUM_MODULE)
        if not fusions["gradient_accumulation_fusion"]:
            why["gradient_accumulation_fusion"] = f"needs apex's {APEX_GRAD_ACCUM_MODULE}"
    why["masked_softmax_fusion"] = "TE attention has its own softmax" if te else "would drop the packed-rows mask"
    why["persist_layer_norm"] = "LayerNorm only; these models use RMSNorm"
    why["cross_entropy_loss_fusion"] = "numloss computes the loss"
    ddp = {"use_distributed_optimizer": cuda and megatron.distributed_optimizer,
           "overlap_grad_reduce": cuda and megatron.overlap_grad_reduce,
           "overlap_param_gather": cuda and megatron.distributed_optimizer and megatron.overlap_param_gather}
    for name, value in ddp.items():
        if value:
            continue
        if not cuda:
            why[name] = "CPU: torch AdamW" if name == "use_distributed_optimizer" else "needs CUDA streams"
        elif name == "overlap_param_gather" and not megatron.distributed_optimizer:
            why[name] = "needs the distributed optimizer"
        else:
            why[name] = "off in the recipe"
    return KernelPlan(spec=TE_SPEC if te else LOCAL_SPEC, fusions=fusions, ddp=ddp, packing="thd" if te else "mask",
                      why_off=why, why_spec=why_spec)
