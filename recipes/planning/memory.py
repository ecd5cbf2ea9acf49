"""The activation memory both engines' cost models share: what one decoder layer keeps for its backward
and what the output layer (the head) holds, per micro-batch of T tokens on one GPU of a TP group of t.

Notation (recipes.planning.shape): h hidden, I intermediate, a heads of size d, k KV heads, V vocabulary,
e bytes per activation (2 in bf16, 4 in fp32).

One layer, per token (flash / fused attention, no dropout):
- the two RMSNorms: a fused norm (Transformer Engine's, inside the QKV and fc1 linears) keeps its input
  and output, e x 4h (/t under sequence parallelism, which keeps them sequence-sharded); the Hugging Face
  RMSNorm (`fp32_norms`) keeps its input in fp32, the normalised input and its product with the weight:
  2 (4 + 2e) h;
- q and k after RoPE, v and the attention output, e (2ad + 2kd)/t (GQA: k and v keep their k heads);
- SwiGLU's gate, silu(gate), up and their product, 4 e I/t (the Megatron engine leaves
  bias_activation_fusion off; a fused SwiGLU would keep 3I);
- the attention kernel's fp32 softmax statistics (log-sum-exp), 4a/t; recompute "selective" (Megatron's
  recompute of core attention) does not keep them;
- eager attention (`eager`: attn_implementation eager) adds k and v repeated to a heads and the a x s
  probabilities in fp32 and e, s the row length.
Full recompute (one layer per checkpoint) keeps the layer's input only, e h per token (/t under SP).

The head: logits [T, V/t] in e, their fp32 copy, its gradient and the logits' gradient, (2e + 8) bytes
each; the chunked head (numloss.chunked_head) holds one vocabulary chunk of min(chunk_size, T/8) tokens'
logits in e and fp32, and the hidden states' fp32 gradient accumulator and a product (4 + e) h per token.
"""

from __future__ import annotations

from recipes.planning.shape import Shape


def layer_activation_bytes(s: Shape, tokens: float, tp: int, e: int, *, sp: bool = False,
                           recompute: str | None = None, fp32_norms: bool = False, eager: bool = False,
                           seq: int = 0) -> float:
    """Bytes one decoder layer keeps for its backward per micro-batch of `tokens` (module docstring);
    `seq`: the row length (eager attention's probabilities)."""
    seq_split = tp if sp else 1
    if recompute == "full":
        return e * s.hidden * tokens / seq_split
    norms = 2 * (4 + 2 * e) * s.hidden if fp32_norms else e * 4 * s.hidden / seq_split
    statistics = 4 * s.heads if recompute != "selective" else 0
    per_token = norms + (e * (2 * s.heads * s.head_dim + 2 * s.kv_heads * s.head_dim + 4 * s.intermediate)
                         + statistics) / tp
    if eager:
        per_token += (e * 2 * (s.heads - s.kv_heads) * s.head_dim + (4 + e) * s.heads * seq) / tp
    return per_token * tokens


def head_bytes(s: Shape, tokens: float, tp: int, act_bytes: int, chunked: bool, chunk_size: int) -> float:
    """Bytes the output layer holds for a micro-batch of `tokens` (module docstring)."""
    if chunked:
        chunk_tokens = min(chunk_size, -(-int(tokens) // 8))  # at least 8 vocab chunks: numloss.chunked_head.MIN_CHUNKS
        per_entry = act_bytes + 4 if act_bytes < 4 else 4
        return chunk_tokens * (s.vocab / tp) * per_entry + tokens * s.hidden * (4 + act_bytes)
    return tokens * (s.vocab / tp) * (2 * act_bytes + 8)
