"""Triton kernels for the one pass over the logits that every term shares (the eager code in
`numloss.logit_stats` stays the reference and the CPU path).

Forward (`row_stats`): one program per row reads the row of V_local logits once, in blocks of BLOCK_V,
in the logits' own dtype, and keeps in fp32 the running row max and the sum of exp(x - max) (on a new
max m' the old sum is rescaled by exp(m - m')), plus the owned target logit. It replaces
`logit_stats.local_row_stats`: what follows it (the numeric columns' gather, an M x N index, and
`combine_across_ranks` with its two collectives under TP) is unchanged, so the TP contract is too.

Backward (`write_gradient`): one program per row reads the row again and writes, in the output's dtype,
`exp(x - lse) · d loss/d lse` plus `d loss/d target` at the owned target column, accumulated in fp32.
The [M, n_local] numeric block is computed beforehand in fp32 from the same formula plus its own
gradient, and written over those entries afterwards: every entry is rounded to the logits' dtype once,
as in the eager path. Forward read + backward read + one write is the floor of this pass; nothing of
size [T, V] is allocated in fp32.

Gradient in place: `write_gradient(..., out=logits)` writes into the logits' own storage. A program
reads each block of its row before it writes that block, and no other program touches the row, so this
is safe for the kernel; whether the caller may lose its logits is the caller's contract
(`compute_logit_stats(grad_in_place=True)`; the chunked head's per-chunk logits are always private).

When the kernels run (`use_fused`): on CUDA tensors when triton imports, unless `NUMLOSS_FUSED=0` or
`fused=False`. On CPU tensors only when asked (`fused=True` or `NUMLOSS_FUSED=interpret`), under
Triton's interpreter, which needs `TRITON_INTERPRET=1` in the environment before triton is first
imported in the process (the tests run those checks in a subprocess for that reason). Triton is imported
on first use, never at `import numloss`.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch

# GPU: a Llama-3 row (V_local = 128256) is 32 blocks of 4096; 8 warps hold one block in registers.
GPU_BLOCK_V = 4096
GPU_WARPS = 8
# Triton's interpreter runs every program in numpy, serially: the larger the block, the fewer steps.
INTERPRETER_BLOCK_V = 1024


def _env_mode() -> str:
    mode = os.environ.get("NUMLOSS_FUSED", "auto").strip().lower()
    if mode not in {"auto", "1", "0", "interpret"}:
        raise ValueError(f"NUMLOSS_FUSED={mode!r}: expected 0 (eager), 1 or auto (fused on CUDA), interpret"
                         " (fused on CPU tensors too, under TRITON_INTERPRET=1)")
    return mode


@lru_cache(maxsize=None)
def triton_imports() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001  (a broken install counts as absent)
        return False
    return True


def interpreting() -> bool:
    """Whether triton runs its interpreter in this process (TRITON_INTERPRET=1 when it was imported)."""
    if not triton_imports():
        return False
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.standard.max, InterpretedFunction)


def use_fused(logits: torch.Tensor, fused: bool | None = None) -> bool:
    """Whether the pass over `logits` runs the Triton kernels (see the module docstring).

    `fused=None` follows NUMLOSS_FUSED (default auto: CUDA with triton); True insists, and is an error
    where the kernels cannot run; False is the eager path."""
    mode = _env_mode()
    if fused is False or (fused is None and mode == "0"):
        return False
    asked = fused is True or mode == "interpret"
    if logits.device.type == "cuda":
        if triton_imports():
            return True
        if asked:
            raise RuntimeError("numloss fused pass asked for (fused=True or NUMLOSS_FUSED=interpret) but triton"
                               " does not import")
        return False
    if not asked:
        return False
    if not interpreting():
        raise RuntimeError(f"numloss fused pass on {logits.device.type} tensors runs under Triton's interpreter:"
                           " set TRITON_INTERPRET=1 before triton is first imported in the process"
                           f" (triton imports: {triton_imports()})")
    if logits.device.type != "cpu":
        raise RuntimeError(f"numloss fused pass: no kernels for {logits.device.type} tensors")
    return True


@lru_cache(maxsize=None)
def _kernels():
    """The two kernels, defined on first use (so `import numloss` never imports triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def row_stats_kernel(x_ptr, stride_x, target_ptr, owns_ptr, max_ptr, sum_ptr, target_out_ptr, V,
                         HAS_TARGET: tl.constexpr, BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride_x
        cols = tl.arange(0, BLOCK_V)
        row_max = tl.full([], -float("inf"), tl.float32)
        sum_exp = tl.full([], 0.0, tl.float32)
        for start in range(0, V, BLOCK_V):
            index = start + cols
            x = tl.load(base + index, mask=index < V, other=-float("inf")).to(tl.float32)
            new_max = tl.maximum(row_max, tl.max(x, axis=0))
            # the block has at least one column, so new_max is finite for finite logits: exp(-inf) = 0
            sum_exp = sum_exp * tl.exp(row_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
            row_max = new_max
        tl.store(max_ptr + row, row_max)
        tl.store(sum_ptr + row, sum_exp)
        if HAS_TARGET:
            target = tl.load(target_ptr + row)
            owns = tl.load(owns_ptr + row)
            value = tl.load(base + target).to(tl.float32)
            tl.store(target_out_ptr + row, tl.where(owns != 0, value, 0.0))

    @triton.jit
    def gradient_kernel(x_ptr, stride_x, out_ptr, stride_out, lse_ptr, grad_lse_ptr, target_ptr, owns_ptr,
                        grad_target_ptr, V, BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_x
        out_row = out_ptr + row * stride_out
        cols = tl.arange(0, BLOCK_V)
        lse = tl.load(lse_ptr + row)
        grad_lse = tl.load(grad_lse_ptr + row)
        target = tl.load(target_ptr + row)
        grad_target = tl.where(tl.load(owns_ptr + row) != 0, tl.load(grad_target_ptr + row), 0.0)
        for start in range(0, V, BLOCK_V):
            index = start + cols
            mask = index < V
            x = tl.load(x_row + index, mask=mask, other=0.0).to(tl.float32)
            grad = tl.exp(x - lse) * grad_lse + tl.where(index == target, grad_target, 0.0)
            tl.store(out_row + index, grad.to(out_ptr.dtype.element_ty), mask=mask)

    return row_stats_kernel, gradient_kernel


def _launch_config(x: torch.Tensor) -> dict:
    if x.device.type == "cuda":
        return {"BLOCK_V": min(GPU_BLOCK_V, max(16, 1 << (x.shape[1] - 1).bit_length())), "num_warps": GPU_WARPS}
    return {"BLOCK_V": min(INTERPRETER_BLOCK_V, max(16, 1 << (x.shape[1] - 1).bit_length()))}


def _rows_of(x: torch.Tensor) -> torch.Tensor:
    """`x` [C, V] with unit column stride (rows may be strided); a copy only if the columns are not."""
    if x.dim() != 2:
        raise ValueError(f"fused pass: expected logits [C, V], got {tuple(x.shape)}")
    return x if x.stride(1) == 1 else x.contiguous()


def row_stats(x: torch.Tensor, target_local: torch.Tensor | None = None, owns_target: torch.Tensor | None = None):
    """(row max [C], sum of exp(x - row max) [C], owned target logit [C] or None), fp32, from logits `x`
    [C, V] in any float dtype, read once. Without `target_local` no target is read (the chunked head picks
    its targets itself)."""
    x = _rows_of(x)
    rows = x.shape[0]
    row_max = torch.empty(rows, dtype=torch.float32, device=x.device)
    sum_exp = torch.empty_like(row_max)
    has_target = target_local is not None
    target = torch.empty_like(row_max) if has_target else None
    if rows:
        kernel = _kernels()[0]
        # the kernel reads targets and ownership as flat arrays: a strided view (a slice of labels) would be
        # read at the wrong addresses
        kernel[(rows,)](x, x.stride(0), target_local.contiguous() if has_target else row_max,
                        owns_target.to(torch.int8).contiguous() if has_target else row_max, row_max, sum_exp,
                        target if has_target else row_max, x.shape[1], HAS_TARGET=has_target, **_launch_config(x))
    return row_max, sum_exp, target


def numeric_block_gradient(x, rows, cols, lse, grad_lse, target_local, owns_target, grad_target, grad_numeric):
    """[M, n] fp32: the full gradient at the numeric entries x[rows, cols] (softmax part, the target's if
    the target is that column, and the numeric columns' own `grad_numeric`), from the logits before any
    in-place write."""
    r = rows[:, None]
    values = (x[r, cols[None, :]].float() - lse[r]).exp_().mul_(grad_lse[r]).add_(grad_numeric)
    hit = (cols[None, :] == target_local[r]) & owns_target[r]
    return values.add_(torch.where(hit, grad_target[r], 0.0))


def write_gradient(x: torch.Tensor, lse, grad_lse, target_local, owns_target, grad_target,
                   num_rows=None, num_cols=None, grad_numeric=None, out: torch.Tensor | None = None) -> torch.Tensor:
    """d loss / d x for logits `x` [C, V] in x's dtype: `exp(x - lse) · grad_lse` plus `grad_target` at the
    owned target column, plus `grad_numeric` [M, n] at (num_rows, num_cols). Into `out` (x itself for a
    gradient in place; a new tensor when None). fp32 arithmetic, one rounding per entry."""
    x = _rows_of(x)
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    elif out.shape != x.shape or out.stride(1) != 1:
        raise ValueError(f"fused pass: gradient buffer {tuple(out.shape)} stride {out.stride()} does not fit"
                         f" logits {tuple(x.shape)}")
    owns = owns_target.to(torch.int8).contiguous()
    numeric = None
    if num_rows is not None and num_rows.numel() and num_cols.numel():
        numeric = numeric_block_gradient(x, num_rows, num_cols, lse, grad_lse, target_local, owns_target,
                                         grad_target, grad_numeric)  # before x may be overwritten
    if x.shape[0]:
        kernel = _kernels()[1]
        kernel[(x.shape[0],)](x, x.stride(0), out, out.stride(0), lse.float().contiguous(),
                              grad_lse.float().contiguous(), target_local.contiguous(), owns,
                              grad_target.float().contiguous(), x.shape[1], **_launch_config(x))
    if numeric is not None:
        out[num_rows[:, None], num_cols[None, :]] = numeric.to(out.dtype)
    return out
