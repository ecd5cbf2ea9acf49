"""What a Megatron-core layout (`train.engine: megatron`, tensor x pipeline x data parallel) costs per GPU:
memory by pipeline stage, the pipeline bubble, the bytes each GPU moves per step inside and across nodes,
and a step time and MFU. `estimate` returns the `recipes.planning.Plan` (its `stages`, one per pipeline
stage); the Megatron engine's plan (recipes.engines.megatron.pure.plan) reads a recipe's settings into it. Every
number is an estimate from the model's shape, with its formula here (nothing here has been measured on a
GPU).

Notation (as recipes.planning.shape): L layers, h hidden, I intermediate, a heads of size d, k KV heads,
V vocabulary (Megatron pads it to a multiple of 128 t), t = megatron.tp_size, p = pp_size, v =
virtual_pp_size (1 without interleaving), D = world / (t p) data-parallel ranks, m = train.grad_accum
micro-batches per step per DP rank, T = micro_batch_size x s tokens per micro-batch (s: sequence length),
e = 2 bytes (bf16) per activation and weight, P_r the parameters one GPU of stage r holds.

Mixture-of-experts models (`moe`, `Placement.ep`): the experts' parameters, states over the expert-data-
parallel group D / ep, activations, all-to-alls and GEMMs are recipes.planning.moe's (its docstring),
on the busiest GPU of the EP group under a routing imbalance (`MoEShape.imbalance`): its experts'
activations (Stage.expert_activations, in the activations and the buffers' one layer), all-to-alls and
expert GEMMs.

Rank order, groups and where they sit: recipes.planning.placement; the layouts Megatron refuses or this
estimate does not cover: recipes.engines.megatron.pure.plan.layout_problems.

Memory per GPU, stage r:
- Model states: P_r = L/p layers' TP shards + the word embedding (V h / t) on the first stage + the output
  layer and final norm on the last (tied embeddings: a copy on both when p > 1). Bytes per parameter with
  the distributed optimizer: 2 (bf16 weights) + 4 (fp32 main grads: the engine builds its DDP with
  grad_reduce_in_fp32=True) + 12 / D (fp32 master weights and Adam's two moments, sharded over DP)
  = 6 + 12/D; without it 18. Averaged over stages P_r = P / (t p).
- Activations one layer keeps per micro-batch (Transformer Engine spec on GPUs: RMSNorm fused into the
  QKV and fc1 linears, their inputs and outputs sequence-sharded under SP and gathered again in backward;
  fused attention, O(s) memory; no dropout): recipes.planning.memory.layer_activation_bytes. recompute
  selective (Megatron's default recompute_modules ["core_attn"]): the softmax statistics are not kept
  (under fused attention that is all it saves, for a second attention forward). recompute full (the
  engine: uniform, one layer per checkpoint): a layer keeps its input only, and one layer is rebuilt at a
  time.
- In flight on stage r under 1F1B: min(p - r, m) micro-batches of its L/p layers; interleaved (v chunks of
  L/(p v) layers): min(2 (p - r - 1) + (v - 1) p + 1, m v) chunk micro-batches (Megatron's warm-up count
  + 1; microbatch_group_size_per_vp_stage = p), L (1 + (p - 1)/(p v)) layers' worth on the first stage.
- The last stage adds the final norm (2 e h per token, /t under SP) and the head (memory.head_bytes with
  V/t: the output layer all-gathers the sequence under SP, so its logits are [T, V/t]).
- Buffers: one layer's activations for the gradients in flight in a layer's backward, two p2p tensors
  [T, h] (/t under SP), the SP all-gather buffer [T, h] and FIXED_BUFFER_GIB (CUDA context, NCCL, cuBLAS
  and TE workspaces: a guess).

Pipeline bubble: (p - 1)/v micro-batch slots of idle time per step on top of m: 1F1B (p - 1)/(m + p - 1)
of the step; interleaved ((p - 1)/v)/(m + (p - 1)/v) (the bubble *time* divided by v; Narayanan et al.
2021 give it against the ideal compute, (p - 1)/(v m)).

Bytes each GPU sends per step (a ring all-gather or reduce-scatter sends (n - 1)/n of the buffer per
rank, an all-reduce twice that; U = T h e):
- TP, per layer per micro-batch, x (t - 1)/t: 4 all-reduces (2 forward, 2 backward) = 8U; with SP 10U,
  not 8U: forward 2 all-gathers + 2 reduce-scatters, backward 2 reduce-scatters + 2 all-gathers of the
  row-parallel linears' output gradients + 2 all-gathers again of the column-parallel linears' inputs for
  their weight gradients (SP keeps only the shard: megatron/core/tensor_parallel/layers.py, backward).
  Embedding (first stage) 2U (SP: a reduce-scatter, U), output layer (last) 2U, 3U with SP. Always inside
  the node (refused otherwise). The objective's own collectives ([T]-sized) are left out.
- PP: per micro-batch the activation [T, h] (/t under SP: Megatron sends the sequence shard) to the next
  stage and its gradient back, v times with interleaving; over the network when the peer is on another
  node.
- DP, once per step (micro-batches accumulate locally): distributed optimizer: reduce-scatter of the fp32
  grads (4 P_r) + all-gather of the bf16 weights (2 P_r), x (D - 1)/D; without: an fp32 all-reduce
  (2 x 4 P_r (D - 1)/D). Tied embeddings at p > 1: their fp32 gradient summed by the first and last stage.
  Where a ring goes: a group with g ranks on each of n > 1 nodes leaves and enters each node once per
  NCCL channel, channels spread over the g NICs of its GPUs (one NIC per GPU), so a GPU sends 1/g of its
  ring bytes over the network and the rest over NVLink.

Step time (recipes.planning.step_model's terms): a micro-batch of b rows padded to s tokens costs stage r
its L/p layers' GEMMs, each at its own rate (recipes.planning.gemm_rates, by the TP-sliced shape), causal
attention (6 s a d T / t per layer) at the layers' rate, a launch overhead per kernel (Transformer
Engine's fused layer), the output layer's GEMMs on the last stage; full recompute adds the forward
again (GEMMs, attention, kernels and its TP collectives), selective the attention's; plus its TP
collectives, not overlapped, and its p2p sends (the engine leaves overlap_p2p_comm off: on the critical
path), each call at NCCL's latency + bytes / bandwidth. Micro-batches are padded as the engine pads them:
under Transformer Engine (the GPU path) its rows' real tokens back to back (THD), under the local spec
each cut at its last real column; either rounded up to data.pad_to_multiple_of and, under SP, t
(data.seq_len's padding dropped: recipes/engines/megatron/runtime/batches.py); one length per step under
interleaving (recipes.planning.padding, with data.length_bucketing's sorted blocks). The slowest stage sets the pace
of each micro-batch; a replica's micro-batches add up, the replicas meet at the step's DP reduction:
step = max over replicas of the sum of its micro-batches + (p - 1)/v mean micro-batches of bubble + DP's
exposed time (overlap_grad_reduce: the reduce-scatter hides behind the last micro-batch's backward, 2/3
of its compute, when Megatron's DDP reduces its buckets; overlap_param_gather: the all-gather behind the
next step's first forward, 1/3; otherwise exposed). The optimizer step itself is left out. MFU = model
FLOPs of the real tokens (6 N per token + 6 a d L per token per row length, N the matmul parameters of
the layers and output layer, no recompute, no padding) / (step x GPUs x peak).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from recipes.planning import gemm_rates
from recipes.planning import moe as moe_math
from recipes.planning import step_model
from recipes.planning.memory import head_bytes, layer_activation_bytes
from recipes.planning.moe import MoEShape
from recipes.planning.placement import Placement, groups, rank_of, span, where
from recipes.planning.plan import Plan, Stage
from recipes.planning.shape import Shape
from recipes.planning.step_model import FIXED_BUFFER_GIB, GiB, Collective, Hardware, layer_matmul_params

ENGINE = "megatron"
# forward + backward kernels of one Megatron-core layer per micro-batch: Transformer Engine fuses the norm into
# the linears and SwiGLU into one kernel (counted from the layer's code, not from a profile)
KERNELS_PER_LAYER = 42

VOCAB_DIVISOR = 128  # Megatron-LM's --make-vocab-size-divisible-by (the engine's padding)
GRAD_BYTES = 4  # fp32 main grads, reduced in fp32 (the engine's grad_reduce_in_fp32=True)
DDP_BUCKET = 40_000_000  # parameters per gradient bucket of Megatron's DDP (its default bucket_size)


# ---- memory --------------------------------------------------------------------------------------------


def padded_vocab(vocab: int, tp: int) -> int:
    return -(-vocab // (VOCAB_DIVISOR * tp)) * VOCAB_DIVISOR * tp


def stage_params(s: Shape, lay: Placement, stage: int, tied: bool, qkv_bias: bool = False, qk_norm: bool = False,
                 moe: MoEShape | None = None) -> float:
    """Parameters one GPU of pipeline stage `stage` holds (its TP shard; norms are replicated over TP,
    Qwen3's per-head q / k norms too: `qk_norm`); with `moe`, its E / ep experts' 1/tp slices and the
    router of each MoE layer, the dense MLP of the others (stage_expert_params: the experts alone)."""
    matrices = layer_matmul_params(s)
    if moe is not None:  # s.intermediate is the active width: put the layer's real MLPs in its place
        f = moe.sparse_fraction
        matrices += -3 * s.hidden * s.intermediate + (1 - f) * 3 * s.hidden * moe.dense_intermediate
    layer = (matrices + (s.heads + 2 * s.kv_heads) * s.head_dim * qkv_bias) / lay.tp + 2 * s.hidden
    layer += 2 * s.head_dim * qk_norm
    if moe is not None:
        layer += moe.sparse_fraction * moe_math.dense_mlp_params_per_gpu(moe, s.hidden, lay.tp)
        layer += stage_expert_params(s, lay, moe) / (s.layers // lay.pp)
    vocab = padded_vocab(s.vocab, lay.tp) * s.hidden / lay.tp
    n = s.layers // lay.pp * layer
    if stage == 0:
        n += vocab
    if stage == lay.pp - 1:
        n += s.hidden + (vocab if not tied or lay.pp > 1 else 0)
    return n


def stage_expert_params(s: Shape, lay: Placement, moe: MoEShape | None) -> float:
    """The routed experts' parameters one GPU of a stage holds: its MoE layers' E / ep experts, 1/tp each."""
    if moe is None:
        return 0.0
    return moe.sparse_fraction * (s.layers // lay.pp) * moe_math.expert_params_per_gpu(moe, s.hidden, lay.tp, lay.ep)


def model_state_bytes(params: float, dp: int, distributed_optimizer: bool) -> float:
    """(2 + 4 + 12/D) bytes per parameter with the distributed optimizer, 18 without."""
    return params * (2 + GRAD_BYTES + (12 / dp if distributed_optimizer else 12))


def layers_in_flight(lay: Placement, layers: int, micro_batches: int, stage: int) -> float:
    """Layer x micro-batch activations stage `stage` holds at its peak under (interleaved) 1F1B."""
    if lay.pp == 1:
        return layers
    if lay.vpp == 1:
        return min(lay.pp - stage, micro_batches) * layers / lay.pp
    chunks = min(2 * (lay.pp - stage - 1) + (lay.vpp - 1) * lay.pp + 1, micro_batches * lay.vpp)
    return chunks * layers / (lay.pp * lay.vpp)


def bubble(pp: int, micro_batches: int, vpp: int = 1) -> float:
    """Idle fraction of a step: ((p - 1)/v) / (m + (p - 1)/v)."""
    idle = (pp - 1) / vpp
    return idle / (micro_batches + idle)


# ---- the plan -------------------------------------------------------------------------------------------


def tp_collectives(s: Shape, lay: Placement, stage: int, tokens: float, e: int, recompute: str | None
                   ) -> list[Collective]:
    """One micro-batch's TP collectives on a GPU of `stage`, inside its node (module docstring): 4
    all-reduces per layer, or with SP 10 all-gathers / reduce-scatters of the [T, h] activations; the
    embedding's all-reduce on the first stage (SP: a reduce-scatter), the output layer's input-gradient
    all-reduce on the last (SP: its input all-gathered in forward and again for the weight gradient, the
    gradient reduce-scattered); full recompute runs the forward's again (2 per layer, SP 4)."""
    t, p = lay.tp, lay.pp
    if t == 1:
        return []
    u = tokens * s.hidden * e
    again = (4 if lay.sp else 2) if recompute == "full" else 0
    first, last = stage == 0, stage == p - 1
    if lay.sp:
        n = s.layers // p * (10 + again) + first + 3 * last
        return [Collective("TP all-gathers / reduce-scatters (SP)", n * step_model.ring_bytes("all_gather", u, t), 1, t, n,
                           "all_gather", t)]
    n = s.layers // p * (4 + again) + first + last
    return [Collective("TP all-reduces", n * step_model.ring_bytes("all_reduce", u, t), 1, t, n, "all_reduce", t)]


def estimate(s: Shape, lay: Placement, *, micro_batch_size: int, grad_accum: int, tied: bool, seq: int | None = None,
         rows: step_model.Rows | None = None, recompute: str | None = None, distributed_optimizer: bool = True,
         overlap_grad_reduce: bool = True, overlap_param_gather: bool = True, chunked_head: bool = False,
         chunk_size: int = 1024, qkv_bias: bool = False, qk_norm: bool = False, hw: Hardware | None = None, e: int = 2,
         timed: bool = True, thd: bool = True, moe: MoEShape | None = None) -> Plan:
    """Memory, traffic and time of every pipeline stage of `lay` (module docstring): memory at `rows.peak`
    tokens per row, time at the rows `rows.deal` gives; `seq` alone: rows of exactly that many tokens.
    `timed` False: memory only (the step time is left at infinity). `thd`: the Transformer Engine spec's
    form, a micro-batch's real tokens back to back (megatron.transformer_impl other than local, on GPUs);
    False: the local spec's rows cut at their last real column. `moe`: the model's experts, spread over
    `lay.ep` (recipes.planning.moe: their model states over the expert-data-parallel group, the MoE
    layers' activations, the all-to-alls, the experts' GEMMs)."""
    t, p, v, m = lay.tp, lay.pp, lay.vpp, grad_accum
    rows = rows or step_model.Rows(seq, seq, f"{seq} tokens per row", np.array([seq]))
    hw = hw or Hardware(gpus_per_node=lay.gpus_per_node, nics_per_node=lay.gpus_per_node)
    seq, b = rows.peak, micro_batch_size
    T = b * seq
    dtype = "bfloat16" if e == 2 else "float32"
    seq_split = t if lay.sp else 1
    # the engine's micro-batches (recipes/engines/megatron/runtime/batches.py): cut at their last real column, or
    # under Transformer Engine their real tokens back to back (THD), a multiple of data.pad_to_multiple_of
    # and of t under SP; interleaved, one length per step
    dealt = rows.deal(b, m, lay.dp, repad=math.lcm(rows.pad_multiple, seq_split), one_length=v > 1, concat=thd)
    T_run = dealt.padded_tokens / (m * lay.dp)  # mean tokens per micro-batch, padding included
    U, U_run = T * s.hidden * e, T_run * s.hidden * e
    vp = padded_vocab(s.vocab, t) * s.hidden / t
    head_shape = Shape(s.layers, s.hidden, s.intermediate, s.heads, s.kv_heads, s.head_dim, padded_vocab(s.vocab, t))
    full_layer = layer_activation_bytes(s, T, t, e, sp=lay.sp)
    stages = []
    dp_colls: list[list[Collective]] = []
    moe_extra = routed = 0.0  # routed: a layer's activations on the tokens the experts receive (busiest EP rank)
    if moe is not None:  # the busiest EP rank's experts receive `share` x the mean tokens (moe's docstring)
        share, f = moe.busiest_share(lay.ep), moe.sparse_fraction
        balanced = f * moe_math.routed_activation_bytes(moe, s.hidden, T, t, e)
        moe_extra = f * moe_math.extra_activation_bytes(moe, s.hidden, T, e) + (share - 1) * balanced
        routed = share * balanced
    full_layer += moe_extra
    for r in range(p):
        st = Stage(r, stage_params(s, lay, r, tied, qkv_bias, qk_norm, moe), expert_params=stage_expert_params(s, lay, moe))
        mem = st.memory
        mem["model states"] = model_state_bytes(st.params - st.expert_params, lay.dp, distributed_optimizer)
        if moe is not None:
            mem["expert states"] = model_state_bytes(st.expert_params, lay.edp, distributed_optimizer)
        held = layers_in_flight(lay, s.layers, m, r)
        if recompute == "full":
            mem["activations"] = held * layer_activation_bytes(s, T, t, e, sp=lay.sp, recompute="full") + full_layer
        else:
            mem["activations"] = held * (layer_activation_bytes(s, T, t, e, sp=lay.sp, recompute=recompute) + moe_extra)
        st.expert_activations = ((1 if recompute == "full" else held) + 1) * routed  # + the buffers' one layer
        if r == p - 1:
            mem["head"] = 2 * e * s.hidden * T / seq_split + head_bytes(head_shape, T, t, e, chunked_head, chunk_size)
        mem["buffers"] = full_layer + 2 * U / seq_split + (U if lay.sp else 0) + FIXED_BUFFER_GIB * GiB
        # traffic per step at the mean padded micro-batch
        st.tp_bytes = m * sum(c.ring for c in tp_collectives(s, lay, r, T_run, e, recompute))
        st.pp_inter, st.pp_intra = (m * x for x in _p2p_bytes(lay, r, U_run / seq_split))
        st.ep_inter, st.ep_intra = (m * x for x in _a2a_bytes(s, lay, moe, T_run, e, recompute))
        # DP, once per step
        dp_group = [rank_of(lay, 0, d, r) for d in range(lay.dp)]
        edp_group = [rank_of(lay, 0, lay.ep * d, r) for d in range(lay.edp)]  # the DP ranks of one EP rank
        colls = []
        for what, n_params, group in (("DP", st.params - st.expert_params, dp_group),
                                      ("expert DP", st.expert_params, edp_group)):
            n, (nodes, per_node) = len(group), span(lay, group)
            if not n_params:
                continue
            buckets = max(1, -(-int(n_params) // DDP_BUCKET))
            kind = "reduce_scatter" if distributed_optimizer else "all_reduce"
            colls.append(Collective(f"{what} gradient {kind.replace('_', '-')}", step_model.ring_bytes(kind, n_params * GRAD_BYTES, n),
                                    nodes, per_node, 1, kind, n, buckets))
            if distributed_optimizer:
                colls.append(Collective(f"{what} parameter all-gather", step_model.ring_bytes("all_gather", n_params * e, n), nodes,
                                        per_node, 1, "all_gather", n, buckets))
        if tied and p > 1 and r in (0, p - 1):
            other = rank_of(lay, 0, 0, p - 1 - r) // lay.gpus_per_node != rank_of(lay, 0, 0, r) // lay.gpus_per_node
            colls.append(Collective("tied embedding all-reduce", vp * GRAD_BYTES, 2 if other else 1, 1, 1, "all_reduce", 2))
        st.dp_inter, st.dp_intra = sum(c.net for c in colls), sum(c.nvl for c in colls)
        dp_colls.append(colls)
        stages.append(st)

    pl = Plan(ENGINE, lay, stages=stages, bubble=bubble(p, m, v), tokens=dealt.real_tokens,
              padding_ratio=dealt.padding_ratio, dp_ring=where(lay, "dp"), pp_ring=where(lay, "pp"))
    pl.memory = pl.peak.memory
    busiest = max(stages, key=lambda st: st.pp_inter + st.dp_inter)  # the network's: EP is its own line
    pl.net_bytes = busiest.pp_inter + busiest.dp_inter
    pl.nvlink_bytes = busiest.tp_bytes + busiest.pp_intra + busiest.dp_intra
    if not timed:
        return pl

    def stage_cost(r: int, tokens: int) -> tuple[dict, float, float]:
        c = step_model.micro_batch_compute(head_shape, rows=b, length=tokens / b, tp=t, layers=s.layers / p, hw=hw,
                                   kernels_per_layer=KERNELS_PER_LAYER, dtype=dtype, recompute=recompute, head=r == p - 1,
                                   head_gemms=4 if chunked_head else 3, mlp=moe is None)
        experts_s = experts_f = a2a = 0.0
        if moe is not None:  # the MLPs' GEMMs, the MoE layers' launches and all-to-alls (recipes.planning.moe)
            experts_s, experts_f = moe_math.expert_compute(hw.rates(dtype), moe, s.hidden, tokens, t, lay.ep, recompute)
            experts_s = (experts_s + moe.sparse_fraction * moe_math.MOE_KERNELS_PER_LAYER * gemm_rates.KERNEL_OVERHEAD_S
                         ) * s.layers / p
            a2a = sum(x.time(hw) for x in _a2a_collectives(s, lay, moe, tokens, e, recompute))
        msg = tokens * s.hidden * e / seq_split
        inter, intra = _p2p_bytes(lay, r, msg)
        # the engine leaves overlap_p2p_comm off: each send on the critical path, one NCCL hop each
        p2p = sum(Collective("p2p", sent, nodes, 1, round(sent / msg), "p2p", 2).time(hw)
                  for sent, nodes in ((inter, 2), (intra, 1)) if sent)
        tp = sum(x.time(hw) for x in tp_collectives(s, lay, r, tokens, e, recompute))
        parts = {"GEMMs": c.gemm_s, "attention": c.attention_s, "kernel launches": c.kernels_s,
                 "output layer": c.head_s, "TP collectives": tp, "pipeline p2p": p2p}
        if moe is not None:
            parts.update({"expert GEMMs": experts_s, "EP all-to-all": a2a})
        flops = c.flops + experts_f * s.layers / p
        work_s = c.gemm_s + c.attention_s + c.head_s + experts_s
        return parts, flops, flops / work_s / 1e12 if work_s else 0.0

    # the stages differ by the embedding (first), the output layer (last) and where their p2p peers sit
    roles = {0, p - 1} | ({max(range(1, p - 1), key=lambda r: stages[r].pp_inter)} if p > 2 else set())

    def slowest_stage(tokens: int):
        return max((stage_cost(r, tokens) for r in roles), key=lambda x: sum(x[0].values()))

    work = step_model.price(dealt, slowest_stage)  # the replicas meet at the step's DP reduction
    typical = dealt.typical.median
    for st in stages:
        parts, st.flops_mb, _ = stage_cost(st.index, typical)
        st.t_compute = (parts["GEMMs"] + parts["attention"] + parts["kernel launches"] + parts["output layer"]
                        + parts.get("expert GEMMs", 0.0))
        st.t_tp, st.t_p2p, st.t_ep = parts["TP collectives"], parts["pipeline p2p"], parts.get("EP all-to-all", 0.0)
    for st, colls in zip(stages, dp_colls):
        rs = sum(c.time(hw) for c in colls if "gradient" in c.name)
        ag = sum(c.time(hw) for c in colls if "parameter all-gather" in c.name)
        rest = sum(c.time(hw) for c in colls if "tied" in c.name)
        if overlap_grad_reduce:  # behind the last micro-batch's backward
            rs = max(0.0, rs - 2 / 3 * st.t_compute)
        if overlap_param_gather and distributed_optimizer:  # behind the next step's first forward
            ag = max(0.0, ag - 1 / 3 * st.t_compute)
        st.t_dp_exposed = rs + ag + rest
    idle = (p - 1) / v * work.seconds / m  # the bubble: (p - 1)/v micro-batch slots at the mean micro-batch
    exposed = max(st.t_dp_exposed for st in stages)
    step = work.seconds + idle + exposed
    parts = dict(work.parts)
    if idle:
        parts["pipeline bubble"] = idle
    if exposed:
        parts["DP exposed"] = exposed
    pl.model_flops = step_model.model_flops(s, dealt.real_tokens, dealt.real_square_tokens)
    pl.step_s, pl.mfu, pl.parts, pl.rate = step, step_model.mfu(pl.model_flops, step, lay.world, hw), parts, work.rate
    pl.flops = stages[0].flops_mb * m
    pl.limit = max(parts, key=parts.get)  # the largest term of the step
    return pl


def _p2p_bytes(lay: Placement, r: int, msg: float) -> tuple[float, float]:
    """(network, NVLink) bytes stage r's busiest GPU sends per micro-batch, `msg` bytes a send."""
    p = lay.pp
    if p == 1:
        return 0.0, 0.0
    sends = ((r + 1) % p, lay.vpp - (r == p - 1)), ((r - 1) % p, lay.vpp - (r == 0))
    worst = (0.0, 0.0)
    for d in range(lay.dp):
        for k in range(lay.tp):
            me = rank_of(lay, k, d, r) // lay.gpus_per_node
            inter = sum(n * msg for peer, n in sends if rank_of(lay, k, d, peer) // lay.gpus_per_node != me)
            worst = max(worst, (inter, sum(n * msg for _, n in sends) - inter))
    return worst


def _a2a_collectives(s: Shape, lay: Placement, moe: MoEShape | None, tokens: float, e: int, recompute: str | None
                     ) -> list[Collective]:
    """One micro-batch's EP all-to-alls on a GPU of a stage (recipes.planning.moe), where its EP group sits."""
    if moe is None or lay.ep == 1:
        return []
    nodes, per_node = span(lay, [rank_of(lay, 0, d, 0) for d in range(lay.ep)])
    return [moe_math.all_to_all_collective(moe, s.hidden, s.layers / lay.pp, tokens / (lay.tp if lay.sp else 1), e,
                                           lay.ep, nodes, per_node, recompute)]


def _a2a_bytes(s: Shape, lay: Placement, moe: MoEShape | None, tokens: float, e: int, recompute: str | None
               ) -> tuple[float, float]:
    colls = _a2a_collectives(s, lay, moe, tokens, e, recompute)
    return sum(c.net for c in colls), sum(c.nvl for c in colls)
