"""The objective from hidden states, without full-vocabulary logits for the whole batch.

At Llama-3 scale (V = 128256) the fp32 logits of 8192 tokens take 4.2 GB and the usual path holds
several copies (logits, the softmax, their gradient). Here `hidden [T, H] @ weightᵀ` is computed one
chunk of tokens at a time; each chunk's logits live only while that chunk is processed.

How the backward avoids a second pass over the vocabulary. The gradient of the loss with respect to
chunk logits is `g_t · softmax_t + S` where `g_t` is d loss / d lse_t and S is sparse (the target logit
and the N numeric columns). So:

- d hidden_t = g_t · (softmax_t @ W) + S_t @ W: the [T, H] products `softmax_t @ W` are kept from the
  forward and scaled by g_t in backward, exactly, whatever g is.
- d W = Σ_t g_t softmax_tᵀ h_t + Sᵀ h: the forward accumulates `Σ_valid softmax_tᵀ h_t` assuming
  g_t = k on every valid row (what token-mean CE gives), straight into the tensor that becomes d W (in
  the weight's dtype: the only [V, H] buffer the head allocates). Backward takes k as the median of g over valid
  rows and corrects, by recomputing their logits, only the rows where g differs from that (the numeric
  rows of a term that uses the full-vocabulary normaliser: GCE, DIST2 "full", NTL `reweigh`). Plain CE,
  SMMD, NTL-WAS, NTIL recompute nothing.

So forward costs three [C, V]x matmuls per chunk and backward only small ones: the same matmul work
as the logits path, with a peak of d W plus one chunk's logits instead of several full copies. A batch is
cut into at least eight chunks, so a chunk's logits never outweigh an eighth of the batch's.

Parallel contract: with a TP group, `weight` is this rank's vocab shard [V_local, H] starting at
`vocab_start`, `hidden` and labels are identical on every rank; each chunk issues the two collectives
of the log-sum-exp, its numeric columns riding in the second (`numloss.parallel`; every rank must see
the same T and chunking, which replicated labels guarantee), and backward all-reduces d hidden over the group,
because this head stands in for a column-parallel linear layer whose input is replicated.

ZeRO-3: the weight must be gathered while this runs, forward and backward. `numloss.hf` registers the
lm_head weight as an external parameter of the module that calls this, so DeepSpeed gathers it with that
module's parameters; every rank calls this function once per step whatever its token count, so the
gathers stay matched.
"""

from __future__ import annotations

import torch

from .logit_stats import (
    IGNORE_INDEX,
    LogitStats,
    combine_across_ranks,
    local_row_stats,
    own_columns_gradient,
    plan_labels,
)
from .parallel import all_reduce_
from .vocab import NumericVocab

DEFAULT_CHUNK_SIZE = 1024


MIN_CHUNKS = 8  # a batch is cut into at least this many chunks (see `chunked_logit_stats`)


class _ChunkedHeadFn(torch.autograd.Function):
    """(hidden [T, H], weight [V_local, H]) -> (lse [T], target_logit [T], numeric logits [M, N]).

    Memory: besides [T, H]-sized buffers, one chunk's logits (fp32, and the weight's dtype) and d W itself,
    which the forward accumulates in the weight's dtype (the gradient autograd hands to the weight; no
    fp32 [V, H] accumulator, no fp32 copy of the weight). Each chunk's contribution is one GEMM that adds
    into d W (fp32 accumulation inside the GEMM), so a bf16 d W is rounded once per chunk.
    """

    @staticmethod
    def forward(ctx, hidden, weight, target_local, owns_target, valid, num_rows, num_cols, layout, chunk_size, group):
        tokens = hidden.shape[0]
        lse = hidden.new_empty(tokens, dtype=torch.float32)
        target = torch.empty_like(lse)
        numeric = hidden.new_empty((num_rows.numel(), layout.columns), dtype=torch.float32)
        softmax_w = hidden.new_empty(hidden.shape, dtype=torch.float32)  # softmax_t @ W per token
        grad_weight = torch.zeros_like(weight)  # Σ_valid softmaxᵀ h: becomes d W in backward
        for start in range(0, tokens, chunk_size):
            end = min(start + chunk_size, tokens)
            h = hidden[start:end]
            logits = h @ weight.t()  # [C, V_local] in the weight's dtype
            x = logits.float()  # fp32 math; no copy for fp32 weights
            lo, hi = torch.searchsorted(num_rows, torch.tensor([start, end], device=num_rows.device)).tolist()
            numeric_owned = x[(num_rows[lo:hi] - start)[:, None], num_cols[None, :]]
            # x is this chunk's own buffer: it becomes exp(x - row max), then the softmax, in place
            row_max, sum_exp, tgt = local_row_stats(x, target_local[start:end], owns_target[start:end], in_place=True)
            lse[start:end], target[start:end], numeric[lo:hi] = combine_across_ranks(
                row_max, sum_exp, tgt, owns_target[start:end], valid[start:end], numeric_owned, layout, group)
            probs = x.mul_(torch.exp(row_max - lse[start:end])[:, None])
            if probs is not logits:  # bf16 weights: the softmax goes back into the chunk's bf16 buffer
                probs = logits.copy_(probs)
                del x
            softmax_w[start:end] = probs @ weight
            grad_weight.addmm_(probs.mul_(valid[start:end, None]).t(), h)
            del logits, probs
        ctx.chunk_size = chunk_size
        ctx.group, ctx.layout = group, layout
        ctx.consumed = False
        ctx.save_for_backward(hidden, weight, lse, softmax_w, grad_weight, target_local, owns_target, valid,
                              num_rows, num_cols)
        return lse, target, numeric

    @staticmethod
    def backward(ctx, grad_lse, grad_target, grad_numeric):
        (hidden, weight, lse, softmax_w, grad_weight, target_local, owns_target, valid,
         num_rows, num_cols) = ctx.saved_tensors
        if ctx.consumed:
            raise RuntimeError("the chunked head's backward reuses its saved buffers: it can run only once"
                               " (retain_graph=True with a second backward is not supported)")
        ctx.consumed = True
        grad_hidden = softmax_w.mul_(grad_lse[:, None])  # in place: the [T, H] buffer is not needed again
        k = grad_lse[valid].median() if valid.any() else grad_lse.new_zeros(())
        grad_weight.mul_(k.item())  # in place: the forward's accumulator is d W (a float scalar: k unrounded)
        # rows whose d loss / d lse differs from k·valid: recompute their softmax and correct d W
        rest = grad_lse - k * valid
        rows = rest.nonzero().flatten()
        for start in range(0, rows.numel(), ctx.chunk_size):
            r = rows[start:start + ctx.chunk_size]
            probs = (hidden[r] @ weight.t()).float().sub_(lse[r, None]).exp_().mul_(rest[r, None])
            grad_weight.addmm_(probs.to(weight.dtype).t(), hidden[r])

        # the sparse part, in fp32 on [T, H]-sized rows: target logits and numeric columns
        owned = owns_target.nonzero().flatten()
        g_target = grad_target[owned, None]
        weight_rows, hidden_rows = [target_local[owned]], [g_target * hidden[owned].float()]
        grad_hidden[owned] += g_target * weight[target_local[owned]].float()  # rows are distinct
        if num_rows.numel() and num_cols.numel():
            grad_numeric = own_columns_gradient(grad_numeric, ctx.layout)
            grad_hidden[num_rows] += grad_numeric @ weight[num_cols].float()
            weight_rows.append(num_cols)
            hidden_rows.append(grad_numeric.t() @ hidden[num_rows].float())
        # summed per weight row in fp32 first, then added to d W once (one rounding for a bf16 d W)
        unique, inverse = torch.cat(weight_rows).unique(return_inverse=True)
        sparse = torch.zeros((unique.numel(), weight.shape[1]), dtype=torch.float32, device=weight.device)
        sparse.index_add_(0, inverse, torch.cat(hidden_rows))
        grad_weight[unique] = sparse.add_(grad_weight[unique]).to(grad_weight.dtype)

        all_reduce_(grad_hidden, "sum", ctx.group)  # the column-parallel input's gradient
        return (grad_hidden.to(hidden.dtype), grad_weight,
                None, None, None, None, None, None, None, None)


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
) -> LogitStats:
    """`LogitStats` of `hidden [..., H] @ weightᵀ` with `labels [...]`, chunk by chunk over tokens.

    `chunk_size` is the largest chunk; a batch of T tokens is cut into at least `MIN_CHUNKS` chunks
    (chunks of min(chunk_size, ceil(T / MIN_CHUNKS)) tokens).

    Equal (up to fp32 rounding) to `compute_logit_stats(hidden @ weight.T, labels, ...)`; see the module
    docstring for memory, the backward and the TP/ZeRO-3 contract.
    """
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} do not align:"
                         " expected hidden [..., H] with labels [...]")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be [V_local, {hidden.shape[-1]}] for hidden {tuple(hidden.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    plan = plan_labels(labels, vocab, weight.shape[0], hidden.device, group, vocab_start, ignore_index, numeric)
    tokens = plan.labels.numel()
    # At least MIN_CHUNKS chunks: the head then never holds more than an eighth of the batch's logits,
    # which is what keeps it below the logits path when d W (as large as the weight) dominates, e.g.
    # 1024 tokens with H = 8192. Every TP rank has the same T (replicated labels): the same chunks.
    chunk_size = max(1, min(chunk_size, -(-tokens // MIN_CHUNKS)))
    lse, target_logit, numeric_logits = _ChunkedHeadFn.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, plan.target_local, plan.owns_target, plan.valid,
        plan.num_rows, plan.layout.local_cols.to(hidden.device), plan.layout, chunk_size, group,
    )
    return plan.stats(lse, target_logit, numeric_logits)
