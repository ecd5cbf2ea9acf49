"""A CPU stand-in for Transformer Engine's THD attention kernel, so the engine's THD path (batches.thd_micro_batch,
megatron's PackedSeqParams plumbing, its THD RoPE over cu_seqlens, the loss on the `[1, T]` row, SP and PP
with a token count per micro-batch) runs on CPU: megatron-core's own `DotProductAttention`, run causally on
each sequence of `cu_seqlens` alone. TE's fused kernel computes that attention; the kernel is the only part
this replaces. A test plan puts it in the local spec (`kernels.KernelPlan.core_attention`)."""

from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention


class PerSequenceAttention(DotProductAttention):
    """`TEDotProductAttention`'s THD interface: query `[t, heads, d]`, key and value `[t, groups, d]` (megatron
    squeezes the batch dimension of a THD row), `packed_seq_params.cu_seqlens_q`; returns `[t, heads * d]`.
    Takes no dense mask (TE under a causal mask type would ignore it)."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise AssertionError("PerSequenceAttention takes THD sequences only")
        if attention_mask is not None:
            raise AssertionError("a dense mask reached THD attention")
        cu = packed_seq_params.cu_seqlens_q.tolist()
        if cu[-1] != query.shape[0] or max(b - a for a, b in zip(cu, cu[1:])) != packed_seq_params.max_seqlen_q:
            raise AssertionError(f"cu_seqlens {cu} do not cover the {query.shape[0]} tokens / max_seqlen")
        parts = [super(PerSequenceAttention, self).forward(query[a:b, None], key[a:b, None], value[a:b, None], None,
                                                           attn_mask_type)
                 for a, b in zip(cu, cu[1:])]
        return torch.cat([part[:, 0] for part in parts])
