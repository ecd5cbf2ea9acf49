"""The DeepSpeed engine's plan: memory per GPU, the bytes each GPU moves per optimizer step by ZeRO stage,
hpZ and reduction dtype, split inside / across nodes, compute, step time and MFU (the shared arithmetic is
recipes.planning.step_model's). Used by recipes.planning.validate (recipes.planning.deepspeed_report
prints it) and by the run log's summary; every number is an estimate from the model's shape.

Shapes: L layers, hidden h, intermediate I, a attention heads of size d, k KV heads, vocabulary V,
tensor-parallel size t, D data-parallel ranks, G = train.grad_accum micro-batches per step, T tokens per
micro-batch, e bytes per weight / activation (2 in bf16, 4 in fp32), r bytes per reduced gradient
(deepspeed.reduce_dtype: 4 fp32, 2 bf16), P parameters.

Memory per GPU:
- Model states: ZeRO-3: P/(t D) x (e weights + 4 fp32 gradient partition + 12 fp32 master weights and
  Adam moments) + the largest module gathered with its gradient (2 e x its parameters / t): at bf16
  DeepSpeed's own estimator (`estimate_zero3_model_states_mem_needs`, tests check it at every shipped
  recipe). ZeRO 1-2: 2 e P/t (weights and their gradients) + 16 P/(t D); ZeRO-0: (2 e + 16) P/t.
- hpZ (`zero_hpz_partition_size` z): the secondary copy of the weights sharded over the node, e P/(t z)
  (Llama-3-70B, z 8: 16.4 GiB), kept from the step's first gather until the optimizer step.
- Buffers: the ZeRO-3 prefetch bucket (e x its elements), the gradient reduce bucket (bf16 gradients and
  their r-byte copy for the reduction), step_model.FIXED_BUFFER_GIB.
- Activations one decoder layer saves for backward, per token, bytes (transformers' Llama/Qwen2 code,
  flash or SDPA attention): each RMSNorm its input in fp32 (4h), the normalised input and its product
  with the weight (2 e h): 2 (4 + 2e) h; q and k after RoPE, v, the attention output e (2ad + 2kd)/t and
  the kernel's fp32 log-sum-exp 4a/t (GQA: k and v keep their k heads); SwiGLU's gate, silu(gate), up and
  their product 4 e I/t. Eager attention adds k and v repeated to a heads and the a x s probabilities in
  fp32 and e. Without gradient checkpointing all L layers; with it each layer's input (e h) and one layer
  recomputed at a time. Rows are the longest the data has (step_model.row_tokens: peak).
- The head (final norm, then the logits or the chunked head): logits [T, V/t] in e, their fp32 copy, its
  gradient and the logits' gradient, (2e + 8) bytes each; chunked (numloss.chunked_head): one vocabulary
  chunk of min(chunk_size, T/8) tokens' logits in e and fp32, d hidden's fp32 accumulator and a product.
Checkpoint on disk: ZeRO-3 saves fp32 master weights and Adam's two moments, 12 bytes per parameter (its
module file holds no weights); ZeRO 0-2 add the e-byte module: (e + 12) P. LoRA: the adapter's only.

Bytes each GPU sends per optimizer step (step_model.ring_bytes; where they go: step_model's docstring):
- ZeRO-3 without hpZ: the parameters all-gathered in every micro-batch's forward and backward (2G x e P/t
  over the D ranks); with hpZ (DeepSpeed 0.19.8, partition_parameters.py and stage3.py `_post_step`):
  the step's first forward gathers over all D ranks, re-partitions into the node's secondary copy, and
  every later gather of the step (2G - 1) uses it, inside the node. Gradients: a reduce-scatter per
  micro-batch (G x r P/t over D; hpZ does not change it). Gradient accumulation therefore adds traffic.
- ZeRO-2: a reduce-scatter per micro-batch, ZeRO-1 one per step; both one parameter all-gather per step.
  ZeRO-0: one all-reduce per step.
- AutoTP: 4 all-reduces of [T, h] per layer per micro-batch (6 under gradient checkpointing: the forward
  runs again), inside the node. DP groups are then t ranks apart: one rank per node at t = 8, so every hop
  of the data-parallel ring crosses the network.
- Left out: the step's small collectives (counts, logged sums, the gradient norm), parameters below the
  persistence threshold (10 h elements), and what `stage3_max_reuse_distance` (1e9 elements) keeps
  gathered between the end of the forward and the backward (about one layer). Counted against a real
  gloo run without prefetching (tests/recipes/planning/test_traffic_gloo.py: equal within 1 %); with prefetching
  DeepSpeed gathered fewer in-node bytes than counted here on a tiny model, so those are an upper bound.
Time (recipes.planning.step_model's terms): a micro-batch of b rows padded to s tokens (each micro-batch to
its longest row, or data.seq_len; recipes.planning.padding, with data.length_bucketing's sorted blocks)
costs its GPU every layer's GEMMs at their own rates (recipes.planning.gemm_rates), causal attention at
the layers' rate, a launch overhead per kernel (the Hugging Face layer's eager kernels), the output
layer's GEMMs (4 with the chunked head, which recomputes the logits), the forward again under gradient
checkpointing, and AutoTP's all-reduces (on the critical path). ZeRO-2/3 meet every micro-batch (its
gathers, its reduce-scatter), so each micro-batch takes its slowest rank's time; ZeRO 0-1 meet at the
step's end. The ZeRO collectives overlap that compute (overlap_comm, prefetch), each NCCL call (a layer's
gather, a bucket's reduction) at its latency + bytes / bandwidth: step = max(compute, sum of collective
times); the optimizer step itself is left out. MFU: model FLOPs of the real tokens / (step x GPUs x peak).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from recipes.planning import step_model as sm
from recipes.planning.device_memory import device_memory
from recipes.planning.step_model import GiB, Collective, Hardware, layer_matmul_params


@dataclass
class Shape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, config) -> "Shape":
        """The config's shape; a mixture-of-experts model's `intermediate` is the SwiGLU width one token runs
        through (top-k experts + the shared expert; averaged with the dense MLP over the layers when some
        have none: recipes.planning.moe), so FLOPs and SwiGLU activations count its active experts."""
        from recipes.planning.moe import MoEShape

        c = getattr(config, "text_config", None) or config
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        moe = MoEShape.of(c)
        width = c.intermediate_size if moe is None else round(
            moe.sparse_fraction * moe.active_intermediate + (1 - moe.sparse_fraction) * moe.dense_intermediate)
        return cls(c.num_hidden_layers, c.hidden_size, width, heads,
                   getattr(c, "num_key_value_heads", None) or heads, head_dim, c.vocab_size)


# ---- memory ----------------------------------------------------------------------------------------------


def layer_activation_bytes(s: Shape, tokens: float, tp: int, seq: int, e: int, eager: bool = False) -> float:
    """Bytes one decoder layer saves for its backward (module docstring)."""
    per_token = 2 * (4 + 2 * e) * s.hidden
    per_token += (e * (2 * s.heads * s.head_dim + 2 * s.kv_heads * s.head_dim + 4 * s.intermediate) + 4 * s.heads) / tp
    if eager:
        per_token += (e * 2 * (s.heads - s.kv_heads) * s.head_dim + (4 + e) * s.heads * seq) / tp
    return per_token * tokens


def activation_bytes(s: Shape, tokens: float, tp: int, seq: int, e: int, checkpointing: bool,
                     eager: bool = False) -> float:
    layer = layer_activation_bytes(s, tokens, tp, seq, e, eager)
    if not checkpointing:
        return s.layers * layer
    return s.layers * s.hidden * tokens * e + layer


def head_bytes(s: Shape, tokens: float, tp: int, act_bytes: int, chunked: bool, chunk_size: int) -> float:
    if chunked:
        chunk_tokens = min(chunk_size, -(-int(tokens) // 8))  # at least 8 vocab chunks: numloss.chunked_head.MIN_CHUNKS
        per_entry = act_bytes + 4 if act_bytes < 4 else 4
        return chunk_tokens * (s.vocab / tp) * per_entry + tokens * s.hidden * (4 + act_bytes)
    return tokens * (s.vocab / tp) * (2 * act_bytes + 8)


def zero_model_states(params: int, largest: int, zero_stage: int, dp: int, tp: int = 1, e: int = 2) -> float:
    """Model-state bytes per GPU (module docstring): DeepSpeed's estimator's at bf16."""
    p, dp = params / tp, max(1, dp)
    if zero_stage == 3:
        return p * (e + 4 + 12) / dp + 2 * e * largest / tp
    if zero_stage in (1, 2):
        return 2 * e * p + 16 * p / dp
    return (2 * e + 16) * p


def checkpoint_bytes(params: int, act_bytes: int, zero_stage: int = 3) -> float:
    return params * (12 + (0 if zero_stage == 3 else act_bytes))


# ---- traffic ---------------------------------------------------------------------------------------------


TP_ALL_REDUCES = "TP all-reduces"  # on the critical path of each micro-batch: priced with its compute


def zero_collectives(params: int, *, zero_stage: int, tp: int, dp: int, ranks_per_node: int, hpz: int,
                     grad_accum: int, e: int, reduce_bytes: int, trainable: int | None = None,
                     shape: Shape | None = None, tokens: float = 0, checkpointing: bool = False,
                     reduce_bucket: int = 0) -> list[Collective]:
    """Every collective one GPU takes part in per optimizer step (module docstring). `trainable`: the
    parameters that get gradients when fewer than `params` (LoRA's adapter). Each ZeRO-3 gather is
    issued a layer at a time (`parts`: the layers, embedding and head), each gradient reduction a
    `reduce_bucket` of elements at a time: every such NCCL call pays its latency."""
    p = params / tp
    g = p if trainable is None else trainable / tp
    G = grad_accum
    per_node = max(1, min(dp, ranks_per_node // tp))  # DP ranks of one group on a node
    nodes = -(-dp // per_node)
    layers = (shape.layers + 2) if shape is not None else 1
    buckets = max(1, -(-int(g) // reduce_bucket)) if reduce_bucket else 1

    def over_dp(name: str, kind: str, buffer: float, calls: int, parts: int) -> Collective:
        return Collective(name, calls * sm.ring_bytes(kind, buffer, dp), nodes, per_node, calls, kind, dp, parts)

    out = []
    if zero_stage == 3:
        if hpz > 1:
            out.append(over_dp("parameter all-gather (the step's first forward)", "all_gather", p * e, 1, layers))
            out.append(Collective("parameter all-gathers (hpZ, inside the node)",
                                  (2 * G - 1) * sm.ring_bytes("all_gather", p * e, hpz), 1, hpz, 2 * G - 1,
                                  "all_gather", hpz, layers))
        else:
            out.append(over_dp("parameter all-gathers (forward and backward)", "all_gather", p * e, 2 * G, layers))
        out.append(over_dp("gradient reduce-scatter", "reduce_scatter", g * reduce_bytes, G, buckets))
    elif zero_stage in (1, 2):
        out.append(over_dp("gradient reduce-scatter", "reduce_scatter", g * reduce_bytes, G if zero_stage == 2 else 1,
                           buckets))
        out.append(over_dp("parameter all-gather (after the optimizer step)", "all_gather", g * e, 1, 1))
    else:
        out.append(over_dp("gradient all-reduce", "all_reduce", g * reduce_bytes, 1, buckets))
    if tp > 1 and shape is not None:
        calls = G * shape.layers * (6 if checkpointing else 4)
        out.append(Collective(TP_ALL_REDUCES, calls * sm.ring_bytes("all_reduce", tokens * shape.hidden * e, tp),
                              1, tp, calls, "all_reduce", tp))
    return [c for c in out if c.ring > 0]


# ---- the plan --------------------------------------------------------------------------------------------


@dataclass
class DSLayout:
    """What a DeepSpeed plan depends on besides the model (the recipe's settings, or a variant of them)."""

    zero_stage: int = 3
    tp: int = 1
    nodes: int = 1
    ranks_per_node: int = 8
    hpz: int = 1
    micro_batch_size: int = 1
    grad_accum: int = 1
    e: int = 2
    reduce_bytes: int = 4
    checkpointing: bool = False
    chunked: bool = False
    chunk_size: int = 1024
    eager: bool = False
    prefetch_bucket: int = 0  # elements
    reduce_bucket: int = 0

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def dp(self) -> int:
        return max(1, self.world // self.tp)


@dataclass
class DSPlan:
    layout: DSLayout
    memory: dict = field(default_factory=dict)  # part -> bytes per GPU
    collectives: list = field(default_factory=list)
    flops: float = 0.0  # per GPU per step, recompute included
    model_flops: float = 0.0  # per GPU per step, no recompute
    t_compute: float = 0.0
    t_comm: float = 0.0
    step_s: float = 0.0
    mfu: float = 0.0
    tokens: float = 0.0  # real tokens per step, all GPUs
    limit: str = ""
    parts: dict = field(default_factory=dict)  # seconds per step by term: what the step time is made of
    padding_ratio: float = 1.0  # tokens run / real tokens
    rate: float = 0.0  # TFLOP/s of the typical micro-batch's GEMMs

    @property
    def total(self) -> float:
        return sum(self.memory.values())

    @property
    def net_bytes(self) -> float:
        return sum(c.net for c in self.collectives)

    @property
    def nvl_bytes(self) -> float:
        return sum(c.nvl for c in self.collectives)


def deepspeed_plan(s: Shape, params: int, largest: int, lay: DSLayout, rows: sm.Rows, hw: Hardware, *,
                   model_states: float | None = None, trainable: int | None = None) -> DSPlan:
    """Memory, traffic, compute and step time of one GPU (module docstring). `model_states`: bytes to use
    instead of zero_model_states (LoRA's estimate)."""
    t, e = lay.tp, lay.e
    pl = DSPlan(lay)
    peak_T = lay.micro_batch_size * rows.peak
    mem = pl.memory
    mem["model states"] = model_states if model_states is not None else zero_model_states(
        params, largest, lay.zero_stage, lay.dp, t, e)
    if lay.zero_stage == 3 and lay.hpz > 1:
        mem["hpZ copy"] = e * params / (t * lay.hpz)
    mem["activations"] = activation_bytes(s, peak_T, t, rows.peak, e, lay.checkpointing, lay.eager)
    mem["head"] = (4 + 2 * e) * s.hidden * peak_T + head_bytes(s, peak_T, t, e, lay.chunked, lay.chunk_size)
    mem["buffers"] = (e * lay.prefetch_bucket * (lay.zero_stage == 3) + (e + lay.reduce_bytes) * lay.reduce_bucket
                      + sm.FIXED_BUFFER_GIB * GiB)
    dealt = rows.deal(lay.micro_batch_size, lay.grad_accum, lay.dp, lockstep=lay.zero_stage >= 2)
    mean_T = dealt.padded_tokens / (lay.grad_accum * lay.dp)  # tokens per micro-batch, padding included
    pl.collectives = zero_collectives(params, zero_stage=lay.zero_stage, tp=t, dp=lay.dp,
                                      ranks_per_node=lay.ranks_per_node, hpz=lay.hpz, grad_accum=lay.grad_accum, e=e,
                                      reduce_bytes=lay.reduce_bytes, trainable=trainable, shape=s, tokens=mean_T,
                                      checkpointing=lay.checkpointing, reduce_bucket=lay.reduce_bucket)
    dtype = "bfloat16" if e == 2 else "float32"
    tp_calls = s.layers * (6 if lay.checkpointing else 4)

    def cost(tokens: int):
        length = tokens / lay.micro_batch_size  # the reader's rows: each padded to the micro-batch's longest
        c = sm.micro_batch_compute(s, rows=lay.micro_batch_size, length=length, tp=t, layers=s.layers, hw=hw,
                                   engine="deepspeed", dtype=dtype, recompute="full" if lay.checkpointing else None,
                                   head=True, head_gemms=(4 if lay.chunked else 3) if trainable is None else 2,
                                   weight_grads=trainable is None)
        parts = {"GEMMs": c.gemm_s, "attention": c.attention_s, "kernel launches": c.kernels_s, "output layer": c.head_s}
        if t > 1:  # AutoTP's all-reduces wait for each layer's output: on the critical path, not overlapped
            ar = Collective(TP_ALL_REDUCES, tp_calls * sm.ring_bytes("all_reduce", tokens * s.hidden * e, t), 1, t,
                            tp_calls, "all_reduce", t)
            parts[TP_ALL_REDUCES] = ar.time(hw)
        return parts, c.flops, c.rate

    work = sm.price(dealt, cost)
    zero = [c for c in pl.collectives if c.name != TP_ALL_REDUCES]
    pl.t_compute, pl.t_comm = work.seconds, sm.comm_time(zero, hw)
    pl.step_s = max(pl.t_compute, pl.t_comm)
    pl.flops, pl.rate, pl.padding_ratio = work.flops, work.rate, dealt.padding_ratio
    pl.tokens = dealt.real_tokens
    pl.model_flops = sm.model_flops(s, dealt.real_tokens, dealt.real_square_tokens) / lay.world
    if trainable is not None:  # LoRA: no weight gradients of the frozen base: 4 of the 6 per token
        pl.model_flops *= 2 / 3
    pl.mfu = sm.mfu(pl.model_flops * lay.world, pl.step_s, lay.world, hw)
    pl.parts = dict(work.parts)
    if pl.t_comm > pl.t_compute:  # the collectives the compute does not hide
        pl.parts[f"communication beyond compute ({sm.slowest(zero, hw).name})"] = pl.t_comm - pl.t_compute
    worst = sm.slowest(zero, hw)
    pl.limit = "compute" if pl.t_compute >= pl.t_comm or worst is None else f"{worst.name} ({worst.bound(hw)})"
    return pl


def fits(pl: DSPlan, hw: Hardware) -> bool:
    return pl.total <= hw.mem_gib * GiB


def advice(s: Shape, params: int, largest: int, lay: DSLayout, rows: sm.Rows, hw: Hardware, *,
           allow_bf16: bool = True) -> list[tuple[str, DSPlan]]:
    """Changes of the layout that the model says shorten the step (or cost fewer GPU-seconds) and fit,
    each with its plan, fastest first."""
    base = deepspeed_plan(s, params, largest, lay, rows, hw)
    tries: list[tuple[str, DSLayout, Hardware]] = []
    G = lay.grad_accum
    if G > 1:
        tries.append((f"one micro-batch per step: train.micro_batch_size={lay.micro_batch_size * G} "
                      "train.grad_accum=1 (ZeRO reduce-scatters every micro-batch's gradients)",
                      replace(lay, micro_batch_size=lay.micro_batch_size * G, grad_accum=1), hw))
        if lay.checkpointing:
            tries.append((f"one micro-batch per step without recompute: train.micro_batch_size="
                          f"{lay.micro_batch_size * G} train.grad_accum=1 model.gradient_checkpointing=false",
                          replace(lay, micro_batch_size=lay.micro_batch_size * G, grad_accum=1, checkpointing=False), hw))
    if allow_bf16 and lay.reduce_bytes == 4 and lay.e == 2:
        tries.append(("deepspeed.reduce_dtype=bf16 (half the gradient bytes; the loss then depends on the "
                      "data-parallel size through bf16 rounding: keep fp32 for loss comparisons)",
                      replace(lay, reduce_bytes=2), hw))
    if lay.checkpointing:
        tries.append(("model.gradient_checkpointing=false (no second forward)", replace(lay, checkpointing=False), hw))
    per_node_dp = lay.ranks_per_node // lay.tp
    if lay.zero_stage == 3 and lay.nodes > 1 and lay.hpz <= 1 and 1 < per_node_dp < lay.dp:
        tries.append((f"hpZ: zero_hpz_partition_size={per_node_dp}", replace(lay, hpz=per_node_dp), hw))
    if lay.tp > 1 and lay.nodes > 1:
        gb = lay.micro_batch_size * G * lay.dp
        dp1 = lay.world
        if gb % dp1 == 0:
            tries.append((f"deepspeed.tp_size=1 with hpZ (TP {lay.tp} leaves one rank per node in each data-parallel"
                          f" ring: every hop crosses the network): {gb // dp1} row(s) per rank",
                          replace(lay, tp=1, hpz=lay.ranks_per_node, micro_batch_size=gb // dp1, grad_accum=1), hw))
    if lay.nodes > 1 and lay.nodes % 2 == 0:
        big = replace(hw, mem_gib=max(hw.mem_gib, device_memory(141.0).usable_gib))  # an H200, less the margin
        gb = lay.micro_batch_size * G * lay.dp
        half = replace(lay, nodes=lay.nodes // 2)
        if gb % half.dp == 0:
            half = replace(half, micro_batch_size=gb // half.dp, grad_accum=1)
            tries.append((f"fewer, larger GPUs: cluster.nodes={half.nodes} of 141 GiB GPUs (H200), "
                          f"{half.micro_batch_size} row(s) per rank in one micro-batch", half, big))
    out = []
    for text, variant, vhw in tries:
        pl = deepspeed_plan(s, params, largest, variant, rows, vhw)
        if not fits(pl, vhw):  # checkpointing may make a variant fit
            if variant.checkpointing or "checkpointing" in text:
                continue
            pl = deepspeed_plan(s, params, largest, replace(variant, checkpointing=True), rows, vhw)
            if not fits(pl, vhw):
                continue
            text += " with model.gradient_checkpointing=true"
        gpu_s, base_gpu_s = pl.step_s * pl.layout.world, base.step_s * lay.world
        if pl.step_s < 0.97 * base.step_s or gpu_s < 0.97 * base_gpu_s:
            out.append((text, pl))
    return sorted(out, key=lambda x: x[1].step_s * x[1].layout.world)


def layer_largest_matrix(s: Shape) -> int:
    return max(s.hidden * s.intermediate, s.hidden * s.heads * s.head_dim)


__all__ = ["Shape", "DSLayout", "DSPlan", "deepspeed_plan", "advice", "zero_collectives", "zero_model_states",
           "activation_bytes", "layer_activation_bytes", "head_bytes", "checkpoint_bytes", "fits", "GiB",
           "layer_matmul_params", "layer_largest_matrix"]
