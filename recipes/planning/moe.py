"""The arithmetic of a mixture-of-experts model that the planners need: its expert shape from the HF
config, total and active parameters, and, per GPU of a Megatron layout with expert parallelism, the
expert weights it holds, the activations its MoE layers keep, the all-to-all bytes its token dispatcher
moves and the GEMM time of its experts. recipes.engines.megatron.pure.costs builds its plan on these;
recipes.planning.shape.Shape.of gives an MoE model the MLP width a token runs through (top-k experts +
the shared expert), so the dense arithmetic (FLOPs, SwiGLU activations) counts the active experts.

Families (HF config keys; transformers 5 stores each layer's experts as fused 3-D parameters
`experts.gate_up_proj` [E, 2 I, h] and `experts.down_proj` [E, h, I], the router as `gate.weight` [E, h]):
- qwen3_moe / qwen2_moe: `num_experts` E, `num_experts_per_tok` k, `moe_intermediate_size` I; layer l is an
  MoE layer when l is not in `mlp_only_layers` and (l + 1) % `decoder_sparse_step` == 0, else a dense
  SwiGLU MLP of `intermediate_size`. qwen2_moe adds a shared expert (a SwiGLU MLP of
  `shared_expert_intermediate_size` every token runs) and its sigmoid gate `shared_expert_gate` [1, h].
- mixtral: `num_local_experts` E, `num_experts_per_tok` k, `intermediate_size` I, every layer MoE.

Parameters (tied embeddings counted once, as transformers' `parameters()` does):
  total  = embeddings (V h, x 2 untied) + final norm h + L x (attention + 2 h norms [+ 2 d q/k norms])
           (attention: (a + 2 k) d h + a d h [+ (a + 2 k) d q/k/v biases: qwen2_moe by its qkv_bias,
           default true; qwen3_moe only with attention_bias, which adds the output's h; mixtral none])
           + per MoE layer (E x 3 h I experts + E h router [+ 3 h I_s + h shared expert and gate])
           + per dense layer 3 h I_dense
  active = total - per MoE layer (E - k) x 3 h I: what one token runs through (its top-k experts, the
           shared expert, the router, attention, both embeddings).
Published totals reproduced from the public configs (tests/recipes/planning/test_moe.py):
Qwen3-30B-A3B 30.53B total / 3.35B active (Qwen: 30.5B / 3.3B), Mixtral-8x22B 140.6B / 39.2B
(Mistral: 141B / 39B).

Megatron with expert parallelism (megatron-core 0.16.1, parallel_state.initialize_model_parallel): the
dense parts are laid out as without experts, tp x pp x D with D = world / (tp pp); the experts on a
second grid of the same ranks, expert-TP (default: tp) x ep x pp x D_e with D_e = world / (tp ep pp) =
D / ep, rank = tp_rank + tp (ep_rank + ep (edp_rank + D_e pp_rank)) (order "tp-cp-ep-dp-pp"): an EP group
is ep consecutive data-parallel ranks (tp apart), inside a node when tp ep divides the GPUs of a node.
So ep must divide D and E (moe_layer.py asserts E % ep == 0), and the experts' width I must divide by
tp. One GPU of a stage holds E / ep experts of each of its MoE layers, each sliced 1/tp:
(E / ep) 3 h I / tp parameters a layer; the router (E h) is replicated over TP and EP.
- Model states: the dense parameters (2 + 4 + 12 / D) bytes each with the distributed optimizer, the
  expert parameters (2 + 4 + 12 / D_e): their optimizer state is sharded over the expert-data-parallel
  group only (Megatron's DDP gives expert parameters their own buffers, reduced over that group).
- Activations of an MoE layer per micro-batch of T tokens (balanced routing: each GPU of the EP group
  receives T k tokens): the SwiGLU intermediates 4 I / tp of the T k routed tokens (Shape.of's k I width,
  as dense), plus the permuted tokens the experts read and the expert outputs the combine reads, 2 e k h
  per token, and the router's fp32 logits and probabilities, 8 E per token. Full recompute keeps the
  layer's input only.
- All-to-all (Megatron's alltoall dispatcher; balanced, x f below): per MoE layer per micro-batch,
  dispatch and combine in forward, their gradients in backward: 4 all-to-alls of the T_local k tokens'
  hidden states (T_local = T / tp under sequence parallelism: the dispatcher exchanges the sequence shard
  and gathers inside the TP group after), each GPU sending T_local k h e (ep - 1) / ep bytes per
  all-to-all; full recompute runs the forward's two again. Of those bytes (ep - g) / (ep - 1) go to the
  ranks of other nodes (g: the group's ranks on one node), over the network; the rest over NVLink.
- Expert GEMMs (balanced, x f below): each of the E / ep local experts receives T k ep / E tokens; its
  three GEMM shapes (gate + up [h, 2 I / tp], down [I / tp, h]), forward and both backward GEMMs, each
  at the rate of its own shape (recipes.planning.gemm_rates): small experts run small, slow GEMMs. The
  router GEMM [T, h] x [h, E] and the shared expert at their rates too. Grouped-GEMM kernels,
  permutation and the MoE layer's extra launches (MOE_KERNELS_PER_LAYER, a guess) are not measured
  here: none of this ran on a GPU.
- Routing imbalance f (`MoEShape.imbalance` >= 1, validate's --moe-imbalance; 1: balanced, the numbers
  above): dropless routing sends a popular expert more than its share, so the busiest GPU of the EP
  group receives f T k tokens, f times the mean (the factor a capacity factor bounds when tokens are
  dropped). On that GPU, what sits on the received tokens is f times the balanced: the experts' input
  (e k h per token, of the 2 e k h above) and their SwiGLU intermediates (4 e k I / tp),
  routed_activation_bytes; the router's and the combine's (the GPU's own T tokens) are not. Each
  all-to-all moves f times the balanced bytes on that GPU's heavier side (it receives f in the dispatch
  and the combine's gradient, sends f back in the combine and the dispatch's gradient; the other side
  is the mean), which sets the call's time: its all-to-all bytes and time x f. Its experts' GEMMs run
  f times the tokens. At ep = 1 every GPU runs its own tokens' experts: no factor; the busiest of ep
  GPUs cannot receive more than every token's copies its E / ep experts can take, ep min(k, E / ep) / k
  times the mean, where f is capped (busiest_share).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from recipes.planning import gemm_rates
from recipes.planning.step_model import Collective

MOE_KERNELS_PER_LAYER = 30  # router, top-k, permute / unpermute, all-to-alls, forward + backward (a guess)
FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")
QKV_BIAS_ONLY = ("qwen2", "qwen2_moe")  # a bias on q, k and v and no other linear layer (qkv_bias)


def imbalance_problem(value) -> str | None:
    """Why `value` is no routing imbalance (MoEShape.imbalance, validate's --moe-imbalance), None if it is."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 1:
        return None
    return (f"moe imbalance: {value!r} is not a number >= 1.0: it is the tokens the busiest EP rank receives over "
            "the mean (1.0: balanced routing; the busiest rank never receives less than the mean)")


@dataclass(frozen=True)
class MoEShape:
    """The experts of an MoE model (module docstring); `moe_layers` of `layers` have them."""

    family: str
    experts: int
    top_k: int
    expert_intermediate: int
    moe_layers: int
    layers: int
    dense_intermediate: int = 0  # the dense MLP of the layers without experts
    shared_intermediate: int = 0  # qwen2_moe's shared expert (0: none)
    imbalance: float = 1.0  # routing: the busiest EP rank receives imbalance x the mean tokens (module docstring)

    def __post_init__(self):
        problem = imbalance_problem(self.imbalance)
        if problem:
            raise ValueError(problem)

    def busiest_share(self, ep: int) -> float:
        """The tokens the busiest of `ep` EP ranks receives over the mean (module docstring): 1 at ep 1,
        else `imbalance`, at most ep min(k, E / ep) / k."""
        if ep == 1:
            return 1.0
        return min(self.imbalance, ep * min(self.top_k, self.experts / ep) / self.top_k)

    @property
    def active_intermediate(self) -> int:
        """The SwiGLU width one token of an MoE layer runs through: top-k experts + the shared expert."""
        return self.top_k * self.expert_intermediate + self.shared_intermediate

    @property
    def sparse_fraction(self) -> float:
        return self.moe_layers / self.layers

    @classmethod
    def of(cls, config) -> "MoEShape | None":
        """The config's experts, None for a dense model (or an unknown family without expert keys)."""
        c = getattr(config, "text_config", None) or config
        kind = getattr(c, "model_type", "")
        layers = c.num_hidden_layers
        if kind in ("qwen3_moe", "qwen2_moe"):
            experts = int(getattr(c, "num_experts", 0) or 0)
            step = int(getattr(c, "decoder_sparse_step", 1) or 1)
            only = set(getattr(c, "mlp_only_layers", None) or [])
            sparse = sum(1 for i in range(layers) if i not in only and experts > 0 and (i + 1) % step == 0)
            if not sparse:
                return None
            shared = int(getattr(c, "shared_expert_intermediate_size", 0) or 0) if kind == "qwen2_moe" else 0
            return cls(kind, experts, int(c.num_experts_per_tok), int(c.moe_intermediate_size), sparse, layers,
                       int(c.intermediate_size), shared)
        if kind == "mixtral":
            return cls(kind, int(c.num_local_experts), int(c.num_experts_per_tok), int(c.intermediate_size), layers,
                       layers, 0, 0)
        if any(getattr(c, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts")):
            raise ValueError(f"model: {kind!r} is a mixture-of-experts model the planner does not size "
                             f"(known: {', '.join(FAMILIES)})")
        return None

    # ---- parameters of one layer (all ranks) ------------------------------------------------------------

    def expert_params(self, hidden: int) -> int:
        """One MoE layer's routed experts: E x 3 h I."""
        return self.experts * 3 * hidden * self.expert_intermediate

    def router_and_shared_params(self, hidden: int) -> int:
        """One MoE layer's parameters every token uses: the router E h, the shared expert and its gate."""
        shared = 3 * hidden * self.shared_intermediate + hidden if self.shared_intermediate else 0
        return self.experts * hidden + shared


def qkv_bias(config) -> bool:
    """Whether the q, k and v projections carry a bias, as transformers builds the family: qwen2 always
    (hard-coded bias=True, no config key), qwen2_moe by `qkv_bias` (Qwen1.5-MoE / Qwen2-MoE: True when
    the key is absent, as in their config.json, which predates it; transformers 4 hard-coded the bias),
    the others (llama, mistral, qwen3, qwen3_moe; mixtral has no key) by `attention_bias`, which biases
    the output projection too (output_bias)."""
    c = getattr(config, "text_config", None) or config
    kind = getattr(c, "model_type", "")
    if kind in QKV_BIAS_ONLY:
        return bool(getattr(c, "qkv_bias", True)) if kind == "qwen2_moe" else True
    return bool(getattr(c, "attention_bias", False))


def output_bias(config) -> bool:
    """Whether the attention's output projection carries a bias: `attention_bias` outside the families
    whose bias is q, k and v's only (QKV_BIAS_ONLY: their modules ignore `attention_bias`)."""
    c = getattr(config, "text_config", None) or config
    return getattr(c, "model_type", "") not in QKV_BIAS_ONLY and bool(getattr(c, "attention_bias", False))


@dataclass(frozen=True)
class ParamCounts:
    total: int
    active: int  # per token
    experts: int  # the routed experts' weights, all layers


def parameter_counts(config) -> ParamCounts:
    """Total, active-per-token and routed-expert parameters from the config alone (module docstring);
    a dense model's active equals its total."""
    c = getattr(config, "text_config", None) or config
    moe = MoEShape.of(c)
    heads = c.num_attention_heads
    d = getattr(c, "head_dim", None) or c.hidden_size // heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    h, kind = c.hidden_size, getattr(c, "model_type", "")
    attn = h * (heads + 2 * kv) * d + heads * d * h
    attn += (heads + 2 * kv) * d * qkv_bias(c) + h * output_bias(c)
    if kind in ("qwen3", "qwen3_moe"):
        attn += 2 * d  # per-head q / k RMSNorm
    layer = attn + 2 * h
    embed = c.vocab_size * h * (1 if getattr(c, "tie_word_embeddings", False) else 2)
    total = embed + h + c.num_hidden_layers * layer
    if moe is None:
        total += c.num_hidden_layers * 3 * h * c.intermediate_size
        return ParamCounts(total, total, 0)
    dense_layers = moe.layers - moe.moe_layers
    total += dense_layers * 3 * h * moe.dense_intermediate
    experts = moe.moe_layers * moe.expert_params(h)
    total += experts + moe.moe_layers * moe.router_and_shared_params(h)
    idle = moe.moe_layers * (moe.experts - moe.top_k) * 3 * h * moe.expert_intermediate
    return ParamCounts(total, total - idle, experts)


# ---- per GPU of a Megatron layout with expert parallelism --------------------------------------------------


def expert_params_per_gpu(moe: MoEShape, hidden: int, tp: int, ep: int) -> float:
    """One MoE layer's expert parameters on one GPU: (E / ep) x 3 h I / tp."""
    return moe.experts / ep * 3 * hidden * moe.expert_intermediate / tp


def dense_mlp_params_per_gpu(moe: MoEShape, hidden: int, tp: int) -> float:
    """One MoE layer's parameters outside the routed experts on one GPU: the router (replicated over TP),
    the shared expert sliced 1/tp and its gate (replicated)."""
    shared = (3 * hidden * moe.shared_intermediate / tp + hidden) if moe.shared_intermediate else 0.0
    return moe.experts * hidden + shared


def extra_activation_bytes(moe: MoEShape, hidden: int, tokens: float, e: int) -> float:
    """What one MoE layer keeps per micro-batch of `tokens` beyond the SwiGLU intermediates the dense
    arithmetic counts at the active width: the permuted tokens and the expert outputs (2 e k h per token)
    and the router's fp32 logits and probabilities (8 E per token)."""
    return tokens * (2 * e * moe.top_k * hidden + 8 * moe.experts)


def routed_activation_bytes(moe: MoEShape, hidden: int, tokens: float, tp: int, e: int) -> float:
    """Of one MoE layer's activations per micro-batch of `tokens`, what sits on the T k routed tokens a GPU
    of the EP group receives under balanced routing: the experts' input (e h each) and their SwiGLU
    intermediates (4 e I / tp each); busiest_share times it on the busiest GPU (module docstring)."""
    return tokens * moe.top_k * e * (hidden + 4 * moe.expert_intermediate / tp)


def all_to_all_bytes(tokens: float, top_k: int, hidden: int, e: int, ep: int) -> float:
    """Bytes one GPU sends in one all-to-all of its `tokens` tokens' k routed copies: T k h e (ep - 1) / ep."""
    return tokens * top_k * hidden * e * (ep - 1) / ep if ep > 1 else 0.0


def all_to_alls_per_layer(recompute: str | None) -> int:
    """Dispatch and combine, forward and backward; full recompute runs the forward's again."""
    return 6 if recompute == "full" else 4


def all_to_all_collective(moe: MoEShape, hidden: int, layers: float, tokens: float, e: int, ep: int, nodes: int,
                          per_node: int, recompute: str | None = None) -> Collective:
    """One micro-batch's all-to-alls on the busiest GPU of its EP group (busiest_share x the balanced
    bytes on its heavier side of each call), holding `tokens` tokens before dispatch (the sequence
    shard under SP) through `layers` layers (the MoE ones among them), its EP group spanning `nodes`
    nodes with `per_node` of its ranks on each; on the critical path (not overlapped)."""
    calls = round(moe.sparse_fraction * layers) * all_to_alls_per_layer(recompute)
    each = all_to_all_bytes(tokens, moe.top_k, hidden, e, ep) * moe.busiest_share(ep)
    return Collective("EP all-to-all", calls * each, nodes, per_node, calls, "all_to_all", ep)


def expert_compute(table: gemm_rates.RateTable, moe: MoEShape, hidden: int, tokens: float, tp: int, ep: int,
                   recompute: str | None = None) -> tuple[float, float]:
    """(seconds, FLOPs) of one layer's MLP GEMMs on one GPU, averaged over the layers (an MoE layer's
    experts, shared expert and router; a dense layer's SwiGLU MLP), for a micro-batch of `tokens` tokens
    per data-parallel rank, forward and both backward GEMMs (full recompute: the forward again), each
    GEMM shape at its own rate (module docstring); the routed experts' on the busiest GPU of the EP group
    (busiest_share x the mean tokens)."""
    per_expert = tokens * moe.top_k * ep / moe.experts * moe.busiest_share(ep)
    gemms = [(per_expert, hidden, 2 * moe.expert_intermediate / tp, moe.experts / ep),
             (per_expert, moe.expert_intermediate / tp, hidden, moe.experts / ep),
             (tokens, hidden, moe.experts, 1)]  # the router, replicated over TP
    if moe.shared_intermediate:
        gemms += [(tokens, hidden, 2 * moe.shared_intermediate / tp, 1), (tokens, moe.shared_intermediate / tp, hidden, 1)]
    if moe.moe_layers < moe.layers:  # the layers with a dense MLP, averaged in
        frac = moe.sparse_fraction
        gemms = [(m, k, n, c * frac) for m, k, n, c in gemms]
        dense = moe.dense_intermediate
        gemms += [(tokens, hidden, 2 * dense / tp, 1 - frac), (tokens, dense / tp, hidden, 1 - frac)]
    passes = 4 if recompute == "full" else 3
    seconds = flops = 0.0
    for m, k, n, count in gemms:
        f = passes * 2.0 * m * n * k * count
        seconds += f / (table.tflops(gemm_rates.intensity(m, n, k)) * 1e12)
        flops += f
    return seconds, flops
