"""What a DeepSpeed layout (ZeRO, hpZ, AutoTP) costs per GPU: memory, the bytes each GPU moves per
optimizer step by ZeRO stage, hpZ and reduction dtype, split inside / across nodes, compute, step time
and MFU (the shared arithmetic is recipes.planning.step_model's, the layer's activations
recipes.planning.memory's). `estimate` returns the `recipes.planning.Plan`; the DeepSpeed engine's plan
(recipes.engines.deepspeed.pure.plan) reads a recipe's settings into it. Every number is an estimate from the
model's shape.

Shapes: L layers, hidden h, intermediate I, a attention heads of size d, k KV heads, vocabulary V,
tensor-parallel size t, D data-parallel ranks, G = train.grad_accum micro-batches per step, T tokens per
micro-batch, e bytes per weight / activation (2 in bf16, 4 in fp32), r bytes per reduced gradient
(deepspeed.reduce_dtype: 4 fp32, 2 bf16), P parameters.

Memory per GPU:
- Model states: ZeRO-3: P/(t D) x (e weights + 4 fp32 gradient partition + 12 fp32 master weights and
  Adam moments) + the largest module gathered with its gradient (2 e x its parameters / t): at bf16
  DeepSpeed's own estimator (`estimate_zero3_model_states_mem_needs`, tests check it at every shipped
  recipe). ZeRO 1-2: 2 e P/t (weights and their gradients) + 16 P/(t D); ZeRO-0: (2 e + 16) P/t.
  Offloaded states live in host memory, as DeepSpeed's estimator counts them: `offload_optimizer` takes
  the fp32 gradient partition, master weights and moments off the GPU (ZeRO-3: e P/(t D) + the gathered
  module; ZeRO 1-2: e P/t), `offload_params` (ZeRO-3) the weight partition (the gathered module left).
- hpZ (`zero_hpz_partition_size` z): the secondary copy of the weights sharded over the node, e P/(t z)
  (Llama-3-70B, z 8: 16.4 GiB), kept from the step's first gather until the optimizer step.
- Buffers: the ZeRO-3 prefetch bucket (e x its elements), the gradient reduce bucket (bf16 gradients and
  their r-byte copy for the reduction), step_model.FIXED_BUFFER_GIB.
- Activations one decoder layer saves for backward (transformers' Llama/Qwen2 code, flash or SDPA
  attention, its RMSNorms in fp32: recipes.planning.memory.layer_activation_bytes with fp32_norms).
  Without gradient checkpointing all L layers; with it each layer's input (e h) and one layer recomputed
  at a time. Rows are the longest the data has (step_model.row_tokens: peak).
- The head: the final norm (2 (4 + 2e) h per token) and the logits or the chunked head
  (recipes.planning.memory.head_bytes).
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

from dataclasses import dataclass, replace

from recipes.parallel_dims import ParallelDims
from recipes.planning import step_model
from recipes.planning.memory import head_bytes, layer_activation_bytes
from recipes.planning.placement import Placement
from recipes.planning.plan import Plan
from recipes.planning.shape import Shape
from recipes.planning.step_model import GiB, Collective, Hardware

ENGINE = "deepspeed"
# forward + backward kernels of one Hugging Face decoder layer per micro-batch: eager norms, RoPE and SwiGLU
# as several element-wise kernels each (counted from the layer's code, not from a profile)
KERNELS_PER_LAYER = 120


# ---- memory ----------------------------------------------------------------------------------------------


def activation_bytes(s: Shape, tokens: float, tp: int, seq: int, e: int, checkpointing: bool,
                     eager: bool = False) -> float:
    """Bytes every layer keeps for the backward of a micro-batch of `tokens` (module docstring)."""
    layer = layer_activation_bytes(s, tokens, tp, e, fp32_norms=True, eager=eager, seq=seq)
    if not checkpointing:
        return s.layers * layer
    return s.layers * s.hidden * tokens * e + layer


def zero_model_states(params: int, largest: int, zero_stage: int, dp: int, tp: int = 1, e: int = 2,
                      offload_optimizer: bool = False, offload_params: bool = False) -> float:
    """Model-state bytes per GPU (module docstring): DeepSpeed's estimator's at bf16. What is offloaded
    stays in host memory: the optimizer's fp32 states and gradient partitions (`offload_optimizer`), the
    ZeRO-3 weight partitions (`offload_params`)."""
    p, dp = params / tp, max(1, dp)
    if zero_stage == 3:
        partition = (0 if offload_params else e) + (0 if offload_optimizer else 4 + 12)
        return p * partition / dp + 2 * e * largest / tp
    if zero_stage in (1, 2):
        return e * p if offload_optimizer else 2 * e * p + 16 * p / dp
    return (2 * e + 16) * p


def lora_memory_estimate(base_params: int, largest_params: int, adapter: int, *, zero_stage: int,
                         dp: int, ranks_per_node: int, weight_bytes: int, offload_optimizer: bool = False,
                         offload_params: bool = False) -> dict:
    """LoRA's model-state bytes per GPU and offloaded bytes per node, in the form of DeepSpeed's estimator
    (P base parameters, A adapter parameters, e bytes per weight, d data-parallel ranks): the frozen base
    P x e, partitioned over d under ZeRO-3 (plus the largest module gathered whole during its forward and
    backward), no gradient, no optimizer state; the adapter's weights A x e (ZeRO-3: / d), fp32 gradients
    A x 4 (ZeRO 2-3: / d), optimizer states A x (8 Adam moments + 4 fp32 master weights under bf16) (ZeRO
    1-3: / d). `offload_optimizer` moves the adapter's optimizer states to host RAM, `offload_params`
    (ZeRO-3) the base's partition."""
    dp = max(dp, 1)
    base = base_params * weight_bytes / (dp if zero_stage == 3 else 1)
    gathered = largest_params * weight_bytes if zero_stage == 3 else 0
    weights = adapter * weight_bytes / (dp if zero_stage == 3 else 1)
    grads = adapter * 4 / (dp if zero_stage >= 2 else 1)
    optimizer = adapter * (8 + (4 if weight_bytes == 2 else 0)) / (dp if zero_stage >= 1 else 1)
    cpu = 0.0
    if offload_optimizer:
        cpu, optimizer = cpu + optimizer, 0.0
    if offload_params and zero_stage == 3:
        cpu, base = cpu + base, 0.0
    return {"gpu_bytes": int(base + gathered + weights + grads + optimizer), "cpu_bytes": int(cpu * ranks_per_node),
            "function": f"recipes.engines.deepspeed.pure.costs (frozen base, {adapter:,} adapter parameters)"}


def checkpoint_bytes(params: int, act_bytes: int, zero_stage: int = 3) -> float:
    return params * (12 + (0 if zero_stage == 3 else act_bytes))


# ---- traffic ---------------------------------------------------------------------------------------------


TP_ALL_REDUCES = "TP all-reduces"  # on the critical path of each micro-batch: priced with its compute
ULYSSES_ALL_TO_ALLS = "Ulysses all-to-alls"  # likewise: each layer's attention waits for its exchange


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
        return Collective(name, calls * step_model.ring_bytes(kind, buffer, dp), nodes, per_node, calls, kind, dp,
                          parts)

    out = []
    if zero_stage == 3:
        if hpz > 1:
            out.append(over_dp("parameter all-gather (the step's first forward)", "all_gather", p * e, 1, layers))
            out.append(Collective("parameter all-gathers (hpZ, inside the node)",
                                  (2 * G - 1) * step_model.ring_bytes("all_gather", p * e, hpz), 1, hpz, 2 * G - 1,
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
        out.append(Collective(TP_ALL_REDUCES,
                              calls * step_model.ring_bytes("all_reduce", tokens * shape.hidden * e, tp),
                              1, tp, calls, "all_reduce", tp))
    return [c for c in out if c.ring > 0]


# ---- the plan --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ZeroSettings:
    """What a DeepSpeed plan depends on besides the model and the placement (a recipe's settings, or a
    variant of them): ZeRO stage and hpZ size, the step's split into micro-batches, bytes per weight /
    activation (`e`) and per reduced gradient, gradient checkpointing, the head, eager attention and the
    offloads and the ZeRO buckets (elements)."""

    zero_stage: int = 3
    hpz: int = 1
    micro_batch_size: int = 1
    grad_accum: int = 1
    e: int = 2
    reduce_bytes: int = 4
    checkpointing: bool = False
    chunked: bool = False
    chunk_size: int = 1024
    eager: bool = False
    offload_optimizer: bool = False
    offload_params: bool = False
    prefetch_bucket: int = 0
    reduce_bucket: int = 0
    sp: int = 1  # DeepSpeed-Ulysses: each row's positions split over sp ranks


def placement(nodes: int, ranks_per_node: int, tp: int = 1, sp: int = 1) -> Placement:
    """DeepSpeed's ranks: AutoTP groups of `tp` consecutive ranks, or Ulysses groups of `sp` consecutive
    ranks, the data-parallel rest (world / (tp x sp))."""
    return Placement(ParallelDims(world=nodes * ranks_per_node, tp=tp, cp=sp), ranks_per_node)


def ulysses_all_to_alls(s: Shape, tokens: float, sp: int, e: int, checkpointing: bool, where: Placement) -> Collective:
    """DeepSpeed-Ulysses' exchanges of one micro-batch of `tokens` (the whole rows' tokens) on one GPU:
    per layer and pass, q, k, v in and the attention output back (each rank sends (sp - 1) / sp of its
    slice's q, k, v and output: e (2 a d + 2 k d) tokens / sp), forward, backward, and the forward again
    under gradient checkpointing. KV heads fewer than sp are repeated to sp before the exchange."""
    kv = max(s.kv_heads, sp)
    per_pass = e * (2 * s.heads + 2 * kv) * s.head_dim * tokens / sp * (sp - 1) / sp
    calls = s.layers * (3 if checkpointing else 2)
    nodes = max(1, -(-sp // where.gpus_per_node))
    return Collective(ULYSSES_ALL_TO_ALLS, calls * per_pass, nodes, min(sp, where.gpus_per_node), 4 * calls,
                      "all_to_all", sp)


def estimate(s: Shape, params: int, largest: int, where: Placement, zero: ZeroSettings, rows: step_model.Rows,
             hw: Hardware, *, model_states: float | None = None, trainable: int | None = None) -> Plan:
    """Memory, traffic, compute and step time of one GPU (module docstring). `model_states`: bytes to use
    instead of zero_model_states (LoRA's estimate); `trainable`: the
    parameters that get gradients when fewer than `params` (LoRA's adapter)."""
    t, e, dp, world, sp = where.tp, zero.e, where.dp, where.world, where.dims.cp
    shard = dp * sp  # ZeRO partitions over every rank of the sequence x data-parallel group
    pl = Plan(ENGINE, where, settings=zero)
    peak_T = zero.micro_batch_size * rows.peak / sp  # this GPU's positions of the micro-batch's rows
    mem = pl.memory
    mem["model states"] = model_states if model_states is not None else zero_model_states(
        params, largest, zero.zero_stage, shard, t, e, zero.offload_optimizer, zero.offload_params)
    if zero.zero_stage == 3 and zero.hpz > 1:
        mem["hpZ copy"] = e * params / (t * zero.hpz)
    mem["activations"] = activation_bytes(s, peak_T, t, rows.peak, e, zero.checkpointing, zero.eager)
    mem["head"] = (4 + 2 * e) * s.hidden * peak_T + head_bytes(s, peak_T, t, e, zero.chunked, zero.chunk_size)
    mem["buffers"] = (e * zero.prefetch_bucket * (zero.zero_stage == 3) + (e + zero.reduce_bytes) * zero.reduce_bucket
                      + step_model.FIXED_BUFFER_GIB * GiB)
    dealt = rows.deal(zero.micro_batch_size, zero.grad_accum, dp, lockstep=zero.zero_stage >= 2)
    mean_T = dealt.padded_tokens / (zero.grad_accum * dp)  # tokens per micro-batch, padding included
    pl.collectives = zero_collectives(params, zero_stage=zero.zero_stage, tp=t, dp=shard,
                                      ranks_per_node=where.gpus_per_node, hpz=zero.hpz, grad_accum=zero.grad_accum,
                                      e=e, reduce_bytes=zero.reduce_bytes, trainable=trainable, shape=s, tokens=mean_T / sp,
                                      checkpointing=zero.checkpointing, reduce_bucket=zero.reduce_bucket)
    pl.net_bytes = sum(c.net for c in pl.collectives)
    pl.nvlink_bytes = sum(c.nvl for c in pl.collectives)
    pl.checkpoint_bytes = checkpoint_bytes(params if trainable is None else trainable, e, zero.zero_stage)
    dtype = "bfloat16" if e == 2 else "float32"
    tp_calls = s.layers * (6 if zero.checkpointing else 4)

    def cost(tokens: int):
        length = tokens / zero.micro_batch_size  # the reader's rows: each padded to the micro-batch's longest
        # Ulysses: each GPU runs 1/sp of the rows' tokens through the linears and, after the all-to-all,
        # heads / sp over the whole rows in attention: priced as a TP group of t x sp at the rows' length
        # (the same FLOPs; the GEMMs' shapes split the other way)
        c = step_model.micro_batch_compute(
            s, rows=zero.micro_batch_size, length=length, tp=t * sp, layers=s.layers, hw=hw, dtype=dtype,
            kernels_per_layer=KERNELS_PER_LAYER, recompute="full" if zero.checkpointing else None, head=True,
            head_gemms=(4 if zero.chunked else 3) if trainable is None else 2, weight_grads=trainable is None)
        parts = {"GEMMs": c.gemm_s, "attention": c.attention_s, "kernel launches": c.kernels_s, "output layer": c.head_s}
        if t > 1:  # AutoTP's all-reduces wait for each layer's output: on the critical path, not overlapped
            ar = Collective(TP_ALL_REDUCES, tp_calls * step_model.ring_bytes("all_reduce", tokens * s.hidden * e, t),
                            1, t, tp_calls, "all_reduce", t)
            parts[TP_ALL_REDUCES] = ar.time(hw)
        if sp > 1:
            parts[ULYSSES_ALL_TO_ALLS] = ulysses_all_to_alls(s, tokens, sp, e, zero.checkpointing, where).time(hw)
        return parts, c.flops, c.rate

    work = step_model.price(dealt, cost)
    if sp > 1:  # listed for the traffic; its time is priced with each micro-batch's compute
        exchange = ulysses_all_to_alls(s, mean_T, sp, e, zero.checkpointing, where)
        pl.collectives.append(replace(exchange, ring=exchange.ring * zero.grad_accum,
                                      calls=exchange.calls * zero.grad_accum))
        pl.net_bytes, pl.nvlink_bytes = pl.net_bytes + pl.collectives[-1].net, pl.nvlink_bytes + pl.collectives[-1].nvl
    zero_colls = [c for c in pl.collectives if c.name not in (TP_ALL_REDUCES, ULYSSES_ALL_TO_ALLS)]
    pl.t_compute, pl.t_comm = work.seconds, step_model.comm_time(zero_colls, hw)
    pl.step_s = max(pl.t_compute, pl.t_comm)
    pl.flops, pl.rate, pl.padding_ratio = work.flops, work.rate, dealt.padding_ratio
    pl.tokens = dealt.real_tokens
    pl.model_flops = step_model.model_flops(s, dealt.real_tokens, dealt.real_square_tokens)
    if trainable is not None:  # LoRA: no weight gradients of the frozen base: 4 of the 6 per token
        pl.model_flops *= 2 / 3
    pl.mfu = step_model.mfu(pl.model_flops, pl.step_s, world, hw)
    pl.parts = dict(work.parts)
    worst = step_model.slowest(zero_colls, hw)
    if pl.t_comm > pl.t_compute:  # the collectives the compute does not hide
        pl.parts[f"communication beyond compute ({worst.name})"] = pl.t_comm - pl.t_compute
    pl.limit = "compute" if pl.t_compute >= pl.t_comm or worst is None else f"{worst.name} ({worst.bound(hw)})"
    return pl
