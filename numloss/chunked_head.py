"""The objective from hidden states, without full-vocabulary logits for the whole batch.

At Llama-3 scale (V = 128256) the fp32 logits of 8192 tokens take 4.2 GB and the usual path holds
several copies (logits, the softmax, their gradient). Here `hidden [T, H] @ weightᵀ` is computed one
chunk of the VOCABULARY at a time: a chunk is the logits of every token for Vc columns, [T, Vc], and it
lives only while that chunk is processed.

Forward, per vocab chunk c: `x = h @ W_cᵀ` (in the weight's dtype, then fp32), merged into running
per-row (max, sum of exp) by the online log-sum-exp rule (on a new max m', the old sum is rescaled by
exp(m - m')); the target logit is picked where the target falls in the chunk, and the numeric columns
that fall in it at the numeric rows. Only after the last chunk are the per-row statistics combined over
the TP ranks, once for the whole batch: a step costs the logits path's two collectives, whatever the
chunking. Saved for backward: hidden, the weight, lse [T] and the small index tensors.

Backward, per vocab chunk: recompute x, form the chunk's gradient of the loss w.r.t. its logits,
`g = exp(x - lse) · d loss/d lse` (fp32) plus the sparse part (d loss/d target logit at the rows whose
target is in the chunk, the numeric columns' gradient at the numeric rows), then
- d W[c] = gᵀ h, written straight into its rows of the weight's gradient: every row of d W is written
  exactly once (no accumulation over chunks: a bf16 d W is rounded once, as the logits path's);
- d h += g W_c, accumulated over chunks in fp32 [T, H].
This is exact for any d loss/d lse (no assumption on the loss), and holds no [T, V] and no extra [V, H]
buffer: the head's memory is d W (which every head produces), one chunk's logits in fp32 and the weight's
dtype, and a few [T, H] buffers.

Cost: four GEMMs of [T, H] x [H, V_local] (forward logits; backward logits again, d W, d h) against the
logits path's three: 4/3 of its matmul work, the price of not storing [T, V].

Chunk size: `chunk_size` keeps its meaning in memory: a chunk holds at most `chunk_size` tokens' worth of
logits, `Vc = min(ceil(V_local / MIN_CHUNKS), max(1, chunk_size · V_local // T))` columns for all T
tokens, rounded down to a multiple of 16 (aligned rows for the kernels' vector loads). So a chunk has at most ceil(V_local / MIN_CHUNKS) columns, about an eighth of the batch's logits:
that keeps the head below the logits path when d W dominates (1024 tokens with H = 8192).

Parallel contract: with a TP group, `weight` is this rank's vocab shard [V_local, H] starting at
`vocab_start`; `hidden` and labels are identical on every rank. Forward issues the two collectives of
the log-sum-exp, once per call, the numeric columns riding in the second (`numloss.parallel`); ranks may
cut their shards into different numbers of chunks (no collective runs per chunk). Backward all-reduces
d hidden over the group, because this head stands in for a column-parallel linear layer whose input is
replicated.

ZeRO-3: the weight must be gathered while this runs, forward and backward. `numloss.hf` registers the
lm_head weight as an external parameter of the module that calls this, so DeepSpeed gathers it with that
module's parameters; every rank calls this function once per step whatever its token count, so the
gathers stay matched.
"""

from __future__ import annotations

import torch

from . import fused_pass
from .logit_stats import IGNORE_INDEX, LogitStats, combine_across_ranks, own_columns_gradient, plan_labels
from .logit_transform import LogitTransform
from .parallel import all_reduce_
from .vocab import NumericVocab

DEFAULT_CHUNK_SIZE = 1024


MIN_CHUNKS = 8  # a chunk has at most ceil(V_local / MIN_CHUNKS) columns (see `chunk_columns`)
# A chunk's width is its logits' row stride: a multiple of 16 columns starts every row of a bf16 chunk on a
# 32-byte boundary, so the kernels' loads of a row vectorise (128-bit); an odd width leaves them scalar.
COLUMN_MULTIPLE = 16


def chunk_columns(tokens: int, vocab_local: int, chunk_size: int) -> int:
    """Vc, the columns of one vocab chunk: at most `chunk_size` tokens' worth of logits ([T, Vc] holds
    no more entries than [chunk_size, V_local]) and at most ceil(V_local / MIN_CHUNKS) columns, rounded
    down to a multiple of COLUMN_MULTIPLE where that leaves at least COLUMN_MULTIPLE."""
    per_budget = max(1, chunk_size * vocab_local // max(tokens, 1))
    width = max(1, min(-(-vocab_local // MIN_CHUNKS), per_budget))
    return width - width % COLUMN_MULTIPLE if width >= COLUMN_MULTIPLE else width


def _group_by_chunk(columns: torch.Tensor, width: int, vocab_local: int) -> tuple[torch.Tensor, list[int]]:
    """The order that sorts `columns` (positions in the shard) by chunk, and the bounds of each chunk's
    run in that order: chunk k's entries are `order[bounds[k]:bounds[k + 1]]`. One host sync, in forward."""
    order = columns.argsort(stable=True)
    starts = torch.arange(0, vocab_local + width, width, device=columns.device).clamp_(max=vocab_local)
    return order, torch.searchsorted(columns[order], starts).tolist()


class _ChunkBuffers:
    """One chunk's logits in the weight's dtype and, for a low-precision weight, their fp32 copy: allocated
    once per pass and reused by every chunk (the last, shorter one takes the front of each), so a pass
    allocates (and first-touches) them once instead of once per chunk."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, width: int, fp32_copy: bool = True,
                 derivative: bool = False):
        """`fp32_copy=False` (the fused kernels, which read any dtype and accumulate in fp32): no fp32 copy.
        `derivative`: an fp32 buffer for a soft cap's dz/dx (`derivative_of`)."""
        size = hidden.shape[0] * min(width, weight.shape[0])
        self.logits = hidden.new_empty(size, dtype=weight.dtype)
        keep_fp32 = fp32_copy and weight.dtype != torch.float32
        self.fp32 = hidden.new_empty(size, dtype=torch.float32) if keep_fp32 else None
        self.derivative = hidden.new_empty(size, dtype=torch.float32) if derivative else None

    def derivative_of(self, x: torch.Tensor) -> torch.Tensor | None:
        return None if self.derivative is None else self.derivative[:x.numel()].view(x.shape)

    def chunk(self, hidden: torch.Tensor, weight_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [T, Vc] in the weight's dtype, fp32 logits [T, Vc]: the same tensor for an fp32 weight or
        without the fp32 copy)."""
        shape = (hidden.shape[0], weight_rows.shape[0])
        logits = torch.mm(hidden, weight_rows.t(), out=self.logits[:shape[0] * shape[1]].view(shape))
        if self.fp32 is None:
            return logits, logits
        return logits, self.fp32[:shape[0] * shape[1]].view(shape).copy_(logits)


class _ChunkedHeadFn(torch.autograd.Function):
    """(hidden [T, H], weight [V_local, H]) -> (lse [T], target_logit [T], numeric logits [M, N]), fp32.

    See the module docstring for the forward (online log-sum-exp over vocab chunks, one TP combine) and
    the backward (d W written once per chunk, d hidden accumulated in fp32). `fused`: each chunk's row
    statistics and gradient come from the Triton kernels of `numloss.fused_pass`, which read the chunk's
    logits in the weight's dtype (no fp32 copy) and write the gradient over them in place (the chunk's
    buffer is private to this function). `transform` (a `LogitTransform`, None: identity): the model's logit
    scale and soft cap, applied to each chunk's fp32 logits (so a low-precision weight keeps an fp32 copy
    on the fused path too); backward multiplies the chunk's gradient by its derivative.
    """

    @staticmethod
    def forward(ctx, hidden, weight, target_local, owns_target, valid, num_rows, num_cols, layout, width, group,
                fused, transform=None):
        tokens, vocab_local = hidden.shape[0], weight.shape[0]
        row_max = hidden.new_full((tokens,), float("-inf"), dtype=torch.float32)
        sum_exp = hidden.new_zeros(tokens, dtype=torch.float32)
        target = hidden.new_zeros(tokens, dtype=torch.float32)  # 0 where this rank does not own the target
        numeric_owned = hidden.new_empty((num_rows.numel(), num_cols.numel()), dtype=torch.float32)
        # where each owned target and each owned numeric column falls, grouped by chunk (computed once)
        target_rows = owns_target.nonzero().flatten()
        order, target_bounds = _group_by_chunk(target_local[target_rows], width, vocab_local)
        target_rows = target_rows[order]
        target_cols = target_local[target_rows]
        num_order, num_bounds = _group_by_chunk(num_cols, width, vocab_local)
        num_cols = num_cols[num_order]
        buffers = _ChunkBuffers(hidden, weight, width, fp32_copy=not fused or transform is not None)
        for k, start in enumerate(range(0, vocab_local, width)):
            _, x = buffers.chunk(hidden, weight[start:start + width])  # [T, Vc] fp32
            if transform is not None:
                transform.apply_(x)
            t0, t1 = target_bounds[k], target_bounds[k + 1]
            rows = target_rows[t0:t1]
            target[rows] = x[rows, target_cols[t0:t1] - start].float()
            n0, n1 = num_bounds[k], num_bounds[k + 1]
            if n1 > n0:
                numeric_owned[:, num_order[n0:n1]] = x[num_rows[:, None], num_cols[None, n0:n1] - start].float()
            # online log-sum-exp: rescale the running sum to the new row max, add this chunk's exp(x - max)
            if fused:  # the chunk's own (max, sum of exp) from one read, merged by the same rule
                chunk_max, chunk_sum, _ = fused_pass.row_stats(x)
                new_max = torch.maximum(row_max, chunk_max)
                sum_exp.mul_(torch.exp(row_max - new_max)).add_(chunk_sum.mul_(torch.exp(chunk_max - new_max)))
            else:
                new_max = torch.maximum(row_max, torch.amax(x, dim=1))  # amax: no argmax (max(dim) is ~7x slower on CPU)
                sum_exp.mul_(torch.exp(row_max - new_max)).add_(x.sub_(new_max[:, None]).exp_().sum(dim=1))
            row_max = new_max
        del buffers
        lse, target, numeric = combine_across_ranks(row_max, sum_exp, target, owns_target, valid, numeric_owned,
                                                    layout, group)
        ctx.width, ctx.bounds = width, (target_bounds, num_bounds)
        ctx.group, ctx.layout, ctx.fused, ctx.transform = group, layout, fused, transform
        ctx.save_for_backward(hidden, weight, lse, target_rows, target_cols, num_rows, num_cols, num_order,
                              target_local, owns_target)
        return lse, target, numeric

    @staticmethod
    def backward(ctx, grad_lse, grad_target, grad_numeric):
        (hidden, weight, lse, target_rows, target_cols, num_rows, num_cols, num_order, target_local,
         owns_target) = ctx.saved_tensors
        (target_bounds, num_bounds), width = ctx.bounds, ctx.width
        grad_target_by_row = grad_target  # [T], what the fused kernel reads
        grad_target = grad_target[target_rows]  # the owned targets' gradients, in chunk order
        grad_numeric = own_columns_gradient(grad_numeric, ctx.layout)[:, num_order]  # [M, n_local], chunk order
        # a frozen input (no gradient wanted) skips its GEMM; the same on every TP rank, as the graph is
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        grad_weight = torch.empty_like(weight, memory_format=torch.contiguous_format) if want_weight else None
        grad_hidden = hidden.new_zeros(hidden.shape, dtype=torch.float32) if want_hidden else None  # fp32 sum
        # bf16: a [T, H] buffer for each chunk's bf16 product before it is added (no mixed-dtype addmm on CPU)
        product = hidden.new_empty(hidden.shape) if want_hidden and weight.dtype != torch.float32 else None
        transform = ctx.transform
        buffers = _ChunkBuffers(hidden, weight, width, fp32_copy=not ctx.fused or transform is not None,
                                derivative=transform is not None and transform.softcap is not None)
        for k, start in enumerate(range(0, weight.shape[0], width)):
            w = weight[start:start + width]
            logits, grad = buffers.chunk(hidden, w)
            if transform is not None:  # the chunk's model logits z, and dz/dx where it is not a constant
                derivative = buffers.derivative_of(grad)
                transform.apply_(grad, derivative)
            n0, n1 = num_bounds[k], num_bounds[k + 1]
            if ctx.fused:  # the chunk's gradient written over its logits, fp32 arithmetic, one rounding
                column = target_local - start
                owned = owns_target & (column >= 0) & (column < w.shape[0])
                numeric = n1 > n0 and num_rows.numel() > 0
                grad = fused_pass.write_gradient(
                    grad, lse, grad_lse, torch.where(owned, column, 0), owned, grad_target_by_row,
                    num_rows if numeric else None, num_cols[n0:n1] - start, grad_numeric[:, n0:n1], out=grad)
            else:
                # d loss / d logits of the chunk, fp32: the softmax scaled by d loss / d lse ...
                grad.sub_(lse[:, None]).exp_().mul_(grad_lse[:, None])
                # ... plus the target logits and the numeric columns that fall in this chunk
                t0, t1 = target_bounds[k], target_bounds[k + 1]
                grad.index_put_((target_rows[t0:t1], target_cols[t0:t1] - start), grad_target[t0:t1],
                                accumulate=True)
                if n1 > n0 and num_rows.numel():
                    grad.index_put_((num_rows[:, None], num_cols[None, n0:n1] - start), grad_numeric[:, n0:n1],
                                    accumulate=True)
            if transform is not None:  # d loss / d x = d loss / d z · dz/dx
                grad.mul_(derivative if derivative is not None else transform.scale)
            if grad is not logits:  # bf16: the gradient goes back into the chunk's bf16 buffer for the GEMMs
                grad = logits.copy_(grad)
            if want_weight:  # d W[c] = gᵀ h, straight into its rows: each row of d W is written once
                torch.mm(grad.t(), hidden, out=grad_weight[start:start + width])
            if product is not None:
                grad_hidden.add_(torch.mm(grad, w, out=product))
            elif want_hidden:
                grad_hidden.addmm_(grad, w)
        del buffers, product
        if want_hidden:
            all_reduce_(grad_hidden, "sum", ctx.group)  # the column-parallel input's gradient
            grad_hidden = grad_hidden.to(hidden.dtype)
        return (grad_hidden, grad_weight,
                None, None, None, None, None, None, None, None, None, None)


def chunked_logit_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    vocab: NumericVocab,
    group=None,
    vocab_start: int = 0,
    ignore_index: int = IGNORE_INDEX,
    numeric: bool = True,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    fused: bool | None = None,
    logit_transform: LogitTransform | None = None,
) -> LogitStats:
    """`LogitStats` of `hidden [..., H] @ weightᵀ` with `labels [...]`, chunk by chunk over the vocabulary.

    `chunk_size` bounds a chunk's logits to `chunk_size` tokens' worth (see `chunk_columns`): with T tokens
    a chunk has min(ceil(V_local / MIN_CHUNKS), chunk_size · V_local // T) columns.

    Equal (up to fp32 rounding) to `compute_logit_stats(hidden @ weight.T, labels, ...)`; see the module
    docstring for memory, the backward and the TP/ZeRO-3 contract. `fused`: as `compute_logit_stats`
    (None: the Triton kernels on CUDA when triton imports, unless NUMLOSS_FUSED=0). `logit_transform`: the
    model's logit scale and soft cap (`numloss.logit_transform`; `LogitTransform.from_model_config`), applied
    to `hidden @ weightᵀ` before every statistic: the stats are those of the model's own logits.
    """
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} do not align:"
                         " expected hidden [..., H] with labels [...]")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be [V_local, {hidden.shape[-1]}] for hidden {tuple(hidden.shape)}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must have the same dtype")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    plan = plan_labels(labels, vocab, weight.shape[0], hidden.device, group, vocab_start, ignore_index, numeric)
    width = chunk_columns(plan.labels.numel(), weight.shape[0], chunk_size)
    lse, target_logit, numeric_logits = _ChunkedHeadFn.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, plan.target_local, plan.owns_target, plan.valid,
        plan.num_rows, plan.layout.local_cols.to(hidden.device), plan.layout, width, group,
        fused_pass.use_fused(hidden, fused),
        None if logit_transform is None or logit_transform.identity else logit_transform,
    )
    return plan.stats(lse, target_logit, numeric_logits)
