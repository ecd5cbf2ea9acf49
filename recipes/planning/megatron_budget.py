"""What a Megatron-core layout (`train.engine: megatron`, tensor x pipeline x data parallel) costs per GPU:
memory by pipeline stage, the pipeline bubble, the bytes each GPU moves per step inside and across nodes,
and a step time and MFU. Called by `recipes.planning.validate` for Megatron recipes; every number is an
estimate from the model's shape, with its formula here (nothing here has been measured on a GPU).

Notation (as recipes.planning.budget): L layers, h hidden, I intermediate, a heads of size d, k KV heads,
V vocabulary (Megatron pads it to a multiple of 128 t), t = megatron.tp_size, p = pp_size, v =
virtual_pp_size (1 without interleaving), D = world / (t p) data-parallel ranks, m = train.grad_accum
micro-batches per step per DP rank, T = micro_batch_size x s tokens per micro-batch (s: sequence length),
e = 2 bytes (bf16) per activation and weight, P_r the parameters one GPU of stage r holds.

Rank order (read in megatron-core 0.16.1): `parallel_state.initialize_model_parallel(order="tp-cp-ep-dp-pp")`
(its docstring still says "tp-dp-pp", the same thing at context = expert parallel = 1; "tp-pp-dp" is the
only other order it supports) numbers rank = tp_rank + t (dp_rank + D pp_rank) (`RankGenerator`,
`generate_masked_orthogonal_rank_groups`). With ranks numbered node by node (G GPUs a node): a TP group
is t consecutive ranks, inside a node when t divides G; a DP group is D ranks t apart, inside a node when
t D <= G; pipeline neighbours are t D apart, on other nodes once t D >= G. The engine uses the default.

Memory per GPU, stage r:
- Model states: P_r = L/p layers' TP shards + the word embedding (V h / t) on the first stage + the output
  layer and final norm on the last (tied embeddings: a copy on both when p > 1). Bytes per parameter with
  the distributed optimizer: 2 (bf16 weights) + 4 (fp32 main grads: the engine builds its DDP with
  grad_reduce_in_fp32=True) + 12 / D (fp32 master weights and Adam's two moments, sharded over DP)
  = 6 + 12/D; without it 18. Averaged over stages P_r = P / (t p).
- Activations one layer keeps per micro-batch, per token (Transformer Engine spec on GPUs: RMSNorm fused
  into the QKV and fc1 linears; fused attention, O(s) memory; no dropout): e x 4h for the two norms'
  inputs and outputs (/t with sequence parallelism, which keeps them sequence-sharded and gathers again in
  backward), e x (2ad + 2kd)/t for q, k, v after RoPE and the attention output, e x 4I/t for SwiGLU as the
  engine builds it (bias_activation_fusion off: fc1's gate and up, silu(gate), their product; a fused
  SwiGLU keeps 3I), 4a/t bytes of fp32 softmax statistics. recompute selective (Megatron's default
  recompute_modules ["core_attn"]): the statistics are not kept (under fused attention that is all it
  saves, for a second attention forward). recompute full (the engine: uniform, one layer per checkpoint):
  a layer keeps its input only, e h per token (/t under SP), and one layer is rebuilt at a time.
- In flight on stage r under 1F1B: min(p - r, m) micro-batches of its L/p layers; interleaved (v chunks of
  L/(p v) layers): min(2 (p - r - 1) + (v - 1) p + 1, m v) chunk micro-batches (Megatron's warm-up count
  + 1; microbatch_group_size_per_vp_stage = p), L (1 + (p - 1)/(p v)) layers' worth on the first stage.
- The last stage adds the final norm (2 e h per token, /t under SP) and the head (budget.head_bytes with
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
  Embedding (first stage) 2U, output layer (last) 2U, 3U with SP. Always inside the node (refused
  otherwise). The objective's own collectives ([T]-sized) are left out.
- PP: per micro-batch the activation [T, h] (/t under SP: Megatron sends the sequence shard) to the next
  stage and its gradient back, v times with interleaving; over the network when the peer is on another
  node.
- DP, once per step (micro-batches accumulate locally): distributed optimizer: reduce-scatter of the fp32
  grads (4 P_r) + all-gather of the bf16 weights (2 P_r), x (D - 1)/D; without: an fp32 all-reduce
  (2 x 4 P_r (D - 1)/D). Tied embeddings at p > 1: their fp32 gradient summed by the first and last stage.
  Where a ring goes: a group with g ranks on each of n > 1 nodes leaves and enters each node once per
  NCCL channel, channels spread over the g NICs of its GPUs (one NIC per GPU), so a GPU sends 1/g of its
  ring bytes over the network and the rest over NVLink.

Step time: a micro-batch costs stage r 6 N_r T FLOPs (N_r its matmul parameters) + 6 s a d T / t per layer
for causal attention (fused kernels skip the masked half), x 4/3 for the layers under full recompute (their
forward again), the attention's x 4/3 under selective, at --gpu-tflops; plus its TP traffic, not
overlapped, at --nvlink-gbps, and its p2p sends (the engine leaves overlap_p2p_comm off: on the critical
path). The slowest stage sets the pace: step = (m + (p - 1)/v) x its micro-batch time + DP's exposed time
(overlap_grad_reduce: the reduce-scatter hides behind the last micro-batch's backward, 2/3 of its compute,
when Megatron's DDP reduces its buckets; overlap_param_gather: the all-gather behind the next step's first
forward, 1/3; otherwise exposed). A collective takes max(network bytes / --net-gbps, NVLink bytes /
--nvlink-gbps). The optimizer step itself is left out. MFU = (6 N T + 6 s a d T L) m D / (step x GPUs x
--gpu-peak-tflops), N the matmul parameters (layers and output layer, not the input embedding), no
recompute.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from recipes.planning import step_model as sm
from recipes.planning.budget import GiB, Shape, head_bytes
from recipes.planning.step_model import (  # noqa: F401  (model_flops_per_token: re-exported)
    FIXED_BUFFER_GIB, Hardware, layer_matmul_params, model_flops_per_token)
VOCAB_DIVISOR = 128  # Megatron-LM's --make-vocab-size-divisible-by (the engine's padding)
GRAD_BYTES = 4  # fp32 main grads, reduced in fp32 (the engine's grad_reduce_in_fp32=True)
ORDERS = ("tp-dp-pp", "tp-pp-dp")


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    vpp: int = 1  # model chunks per pipeline rank (1: no interleaving)
    sp: bool = False
    gpus_per_node: int = 8
    order: str = "tp-dp-pp"

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


def rank_of(lay: Layout, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
    """Global rank of a (tp, dp, pp) coordinate in Megatron's order (the first name varies fastest)."""
    size, coord = {"tp": lay.tp, "dp": lay.dp, "pp": lay.pp}, {"tp": tp_rank, "dp": dp_rank, "pp": pp_rank}
    rank, stride = 0, 1
    for name in lay.order.split("-"):
        rank, stride = rank + coord[name] * stride, stride * size[name]
    return rank


def groups(lay: Layout, kind: str) -> list[list[int]]:
    """Every `kind` ("tp", "dp" or "pp") group's ranks, as megatron's RankGenerator.get_ranks(kind)."""
    out: dict[tuple, list[int]] = {}
    for i in range(lay.tp):
        for j in range(lay.dp):
            for k in range(lay.pp):
                key = tuple(c for c, n in zip((i, j, k), ("tp", "dp", "pp")) if n != kind)
                out.setdefault(key, []).append(rank_of(lay, i, j, k))
    return sorted(sorted(g) for g in out.values())


def span(lay: Layout, group: list[int]) -> tuple[int, int]:
    """(nodes the group spans, ranks it has on each node: the most on one)."""
    per_node: dict[int, int] = {}
    for r in group:
        per_node[r // lay.gpus_per_node] = per_node.get(r // lay.gpus_per_node, 0) + 1
    return len(per_node), max(per_node.values())


def split_ring(lay: Layout, group: list[int], ring_bytes: float) -> tuple[float, float]:
    """(network, NVLink) bytes of one GPU's `ring_bytes` in a collective over `group` (step_model)."""
    return sm.split_ring(ring_bytes, *span(lay, group))


def layout_problems(shape: Shape, lay: Layout, grad_accum: int) -> list[str]:
    """Errors, each naming its keys, for a layout Megatron refuses or the estimate does not cover."""
    out = []
    if shape.layers % (lay.pp * lay.vpp):
        out.append(f"megatron.pp_size x megatron.virtual_pp_size: {lay.pp} x {lay.vpp} does not divide the "
                   f"model's {shape.layers} layers")
    for what, n in (("attention heads", shape.heads), ("KV heads (query groups)", shape.kv_heads),
                    ("intermediate size", shape.intermediate)):
        if n % lay.tp:
            out.append(f"megatron.tp_size: {lay.tp} does not divide the model's {n} {what}")
    if lay.vpp > 1 and grad_accum % lay.pp:
        out.append(f"train.grad_accum: {grad_accum} micro-batches must be a multiple of megatron.pp_size "
                   f"{lay.pp} under interleaving (megatron.virtual_pp_size {lay.vpp}: Megatron's micro-batch "
                   "groups per virtual stage)")
    return out


# ---- memory --------------------------------------------------------------------------------------------


def padded_vocab(vocab: int, tp: int) -> int:
    return -(-vocab // (VOCAB_DIVISOR * tp)) * VOCAB_DIVISOR * tp


def stage_params(s: Shape, lay: Layout, stage: int, tied: bool, qkv_bias: bool = False) -> float:
    """Parameters one GPU of pipeline stage `stage` holds (its TP shard; norms are replicated over TP)."""
    layer = (layer_matmul_params(s) + (s.heads + 2 * s.kv_heads) * s.head_dim * qkv_bias) / lay.tp + 2 * s.hidden
    vocab = padded_vocab(s.vocab, lay.tp) * s.hidden / lay.tp
    n = s.layers // lay.pp * layer
    if stage == 0:
        n += vocab
    if stage == lay.pp - 1:
        n += s.hidden + (vocab if not tied or lay.pp > 1 else 0)
    return n


def model_state_bytes(params: float, dp: int, distributed_optimizer: bool) -> float:
    """(2 + 4 + 12/D) bytes per parameter with the distributed optimizer, 18 without."""
    return params * (2 + GRAD_BYTES + (12 / dp if distributed_optimizer else 12))


def layer_activation_bytes(s: Shape, tokens: int, tp: int, sp: bool, recompute: str | None, e: int = 2) -> float:
    """Bytes one layer keeps for its backward per micro-batch of `tokens` (module docstring)."""
    seq_split = tp if sp else 1
    if recompute == "full":
        return e * s.hidden * tokens / seq_split
    kept = e * 4 * s.hidden * tokens / seq_split
    kept += e * (2 * s.heads * s.head_dim + 2 * s.kv_heads * s.head_dim + 4 * s.intermediate) * tokens / tp
    if recompute != "selective":
        kept += 4 * s.heads * tokens / tp  # fp32 softmax statistics of the fused attention
    return kept


def layers_in_flight(lay: Layout, layers: int, micro_batches: int, stage: int) -> float:
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


@dataclass
class Stage:
    index: int
    params: float
    memory: dict = field(default_factory=dict)  # part -> bytes
    tp_bytes: float = 0.0  # per step, NVLink
    pp_inter: float = 0.0  # per step
    pp_intra: float = 0.0
    dp_inter: float = 0.0
    dp_intra: float = 0.0
    flops_mb: float = 0.0  # per micro-batch, recompute included
    t_compute: float = 0.0  # seconds per micro-batch
    t_tp: float = 0.0
    t_p2p: float = 0.0
    t_dp_exposed: float = 0.0

    @property
    def total(self) -> float:
        return sum(self.memory.values())

    @property
    def t_mb(self) -> float:
        return self.t_compute + self.t_tp + self.t_p2p


@dataclass
class Plan:
    layout: Layout
    stages: list[Stage]
    bubble: float
    step_s: float
    model_flops: float  # per step, all GPUs
    mfu: float
    tokens: int  # per step, all GPUs
    dp_ring: str  # where the DP group sits
    pp_ring: str

    @property
    def peak(self) -> Stage:
        return max(self.stages, key=lambda st: st.total)


def _where(lay: Layout, kind: str) -> str:
    size = {"tp": lay.tp, "dp": lay.dp, "pp": lay.pp}[kind]
    if size == 1:
        return "of size 1"
    nodes, g = span(lay, groups(lay, kind)[0])
    return "inside a node" if nodes == 1 else f"across {nodes} nodes, {g} rank(s) per node"


def plan(s: Shape, lay: Layout, *, micro_batch_size: int, seq: int, grad_accum: int, tied: bool,
         recompute: str | None = None, distributed_optimizer: bool = True, overlap_grad_reduce: bool = True,
         overlap_param_gather: bool = True, chunked_head: bool = False, chunk_size: int = 1024,
         qkv_bias: bool = False, gpu_tflops: float = 400.0, net_gbps: float = 400.0,
         nvlink_gbps: float = 2880.0, gpu_peak_tflops: float = 989.0, e: int = 2) -> Plan:
    """Memory, traffic and time of every pipeline stage of `lay` (module docstring)."""
    t, p, v, m = lay.tp, lay.pp, lay.vpp, grad_accum
    T = micro_batch_size * seq
    # net_gbps: each GPU's share of its node's NICs
    hw = Hardware(gpu_tflops=gpu_tflops, peak_tflops=gpu_peak_tflops, nic_gbps=net_gbps, nvlink_gbps=nvlink_gbps,
                  nics_per_node=lay.gpus_per_node, gpus_per_node=lay.gpus_per_node)
    net, nvl = hw.net_gbps_per_gpu / 8 * 1e9, hw.nvlink_Bps
    seq_split = t if lay.sp else 1
    U = T * s.hidden * e
    ring_t = (t - 1) / t
    vp = padded_vocab(s.vocab, t) * s.hidden / t
    full_layer = layer_activation_bytes(s, T, t, lay.sp, None, e)
    attn_mb = 6 * seq * s.heads * s.head_dim * T / t  # per layer
    stages = []
    for r in range(p):
        st = Stage(r, stage_params(s, lay, r, tied, qkv_bias))
        mem = st.memory
        mem["model states"] = model_state_bytes(st.params, lay.dp, distributed_optimizer)
        held = layers_in_flight(lay, s.layers, m, r)
        if recompute == "full":
            mem["activations"] = held * layer_activation_bytes(s, T, t, lay.sp, "full", e) + full_layer
        else:
            mem["activations"] = held * layer_activation_bytes(s, T, t, lay.sp, recompute, e)
        if r == p - 1:
            head_shape = Shape(s.layers, s.hidden, s.intermediate, s.heads, s.kv_heads, s.head_dim,
                               padded_vocab(s.vocab, t))
            mem["head"] = 2 * e * s.hidden * T / seq_split + head_bytes(head_shape, T, t, e, chunked_head, chunk_size)
        mem["buffers"] = full_layer + 2 * U / seq_split + (U if lay.sp else 0) + FIXED_BUFFER_GIB * GiB
        # TP, inside the node
        per_mb = s.layers / p * (10 if lay.sp else 8) * U * ring_t
        per_mb += (2 * U * ring_t if r == 0 else 0) + ((3 if lay.sp else 2) * U * ring_t if r == p - 1 else 0)
        st.tp_bytes = m * per_mb
        # PP p2p: every GPU of the stage alike up to placement: the worst one
        msg = U / seq_split
        worst = (0.0, 0.0)
        if p > 1:
            sends = ((r + 1) % p, m * (v - (r == p - 1))), ((r - 1) % p, m * (v - (r == 0)))
            for d in range(lay.dp):
                for k in range(t):
                    me = rank_of(lay, k, d, r) // lay.gpus_per_node
                    inter = sum(n * msg for peer, n in sends if rank_of(lay, k, d, peer) // lay.gpus_per_node != me)
                    intra = sum(n * msg for _, n in sends) - inter
                    worst = max(worst, (inter, intra))
        st.pp_inter, st.pp_intra = worst
        # DP, once per step
        dp_group = [rank_of(lay, 0, d, r) for d in range(lay.dp)]
        ring_d = (lay.dp - 1) / lay.dp
        if distributed_optimizer:
            colls = [st.params * GRAD_BYTES * ring_d, st.params * e * ring_d]  # reduce-scatter, all-gather
        else:
            colls = [2 * st.params * GRAD_BYTES * ring_d, 0.0]
        splits = [split_ring(lay, dp_group, c) for c in colls]
        st.dp_inter, st.dp_intra = sum(x for x, _ in splits), sum(y for _, y in splits)
        if tied and p > 1 and r in (0, p - 1):
            other = rank_of(lay, 0, 0, p - 1 - r) // lay.gpus_per_node != rank_of(lay, 0, 0, r) // lay.gpus_per_node
            tied_bytes = vp * GRAD_BYTES  # an all-reduce over 2 ranks: the buffer once
            st.dp_inter += tied_bytes * other
            st.dp_intra += tied_bytes * (not other)
            splits.append((tied_bytes * other, tied_bytes * (not other)))
        # time
        layer_flops = 6 * layer_matmul_params(s) / t * T
        if recompute == "full":
            layers = (layer_flops + attn_mb) * 4 / 3
        elif recompute == "selective":
            layers = layer_flops + attn_mb * 4 / 3
        else:
            layers = layer_flops + attn_mb
        st.flops_mb = s.layers / p * layers + (6 * vp * T if r == p - 1 else 0)
        st.t_compute = t_compute = hw.compute_s(st.flops_mb)
        st.t_tp, st.t_p2p = per_mb / nvl, max(st.pp_inter / net, st.pp_intra / nvl) / m
        times = [max(a / net, b / nvl) for a, b in splits]
        rs, ag, rest = times[0], times[1], sum(times[2:])
        if overlap_grad_reduce:
            rs = max(0.0, rs - 2 / 3 * t_compute)
        if overlap_param_gather and distributed_optimizer:
            ag = max(0.0, ag - 1 / 3 * t_compute)
        st.t_dp_exposed = rs + ag + rest
        stages.append(st)
    slowest = max(st.t_mb for st in stages)
    step = (m + (p - 1) / v) * slowest + max(st.t_dp_exposed for st in stages)
    tokens = T * m * lay.dp
    flops = model_flops_per_token(s, seq) * tokens
    return Plan(lay, stages, bubble(p, m, v), step, flops, sm.mfu(flops, step, lay.world, hw),
                tokens, _where(lay, "dp"), _where(lay, "pp"))


# ---- recipes.planning.validate's part -----------------------------------------------------------------


def layout_of(recipe) -> tuple[Layout, list[str]]:
    """The recipe's layout and the errors it has before the model's shape is known (keys named)."""
    mg, cl = recipe.megatron, recipe.cluster
    per_node = cl.ranks_per_node()
    world = cl.nodes * per_node
    errors = []
    if world % (mg.tp_size * mg.pp_size):
        errors.append(f"megatron.tp_size x megatron.pp_size: {mg.tp_size} x {mg.pp_size} = {mg.tp_size * mg.pp_size}"
                      f" does not divide cluster.nodes x cluster.gpus_per_node = {cl.nodes} x {per_node} = {world} "
                      "(data-parallel size = world / (tp x pp))")
    if per_node > 0 and per_node % mg.tp_size:
        key = "cluster.gpus_per_node" if cl.gpus_per_node else "cluster.cpu_ranks_per_node"
        errors.append(f"megatron.tp_size: {mg.tp_size} does not divide {key} {per_node}: a TP group would span "
                      "nodes (its all-reduces run every layer: keep TP inside a node)")
    if mg.sequence_parallel and mg.tp_size == 1:
        errors.append("megatron.sequence_parallel: needs megatron.tp_size > 1")
    vpp = mg.virtual_pp_size or 1
    if mg.virtual_pp_size is not None and (mg.pp_size < 2 or vpp < 2):
        errors.append(f"megatron.virtual_pp_size: {mg.virtual_pp_size} needs megatron.pp_size >= 2 and a value >= 2 "
                      "(null: no interleaving)")
        vpp = 1
    dp = max(1, world // (mg.tp_size * mg.pp_size))
    return Layout(mg.tp_size, mg.pp_size, dp, vpp, mg.sequence_parallel and mg.tp_size > 1,
                  max(1, per_node)), errors


def megatron_layout(rep, recipe) -> tuple[int, str]:
    """validate's section 5 for Megatron recipes: errors on rep; (data-parallel size, layout line)."""
    lay, errors = layout_of(recipe)
    rep.errors.extend(errors)
    mg, cl = recipe.megatron, recipe.cluster
    unit = "GPU(s)" if cl.gpus_per_node else "CPU rank(s)"
    inter = f", interleaved x {lay.vpp}" if lay.vpp > 1 else ""
    text = (f"{cl.nodes} node(s) x {cl.ranks_per_node()} {unit}, Megatron TP {lay.tp}{' + SP' if lay.sp else ''} "
            f"x PP {lay.pp}{inter} x DP {lay.dp}, {'distributed' if mg.distributed_optimizer else 'replicated'} "
            f"optimizer, recompute {mg.recompute or 'none'}")
    return lay.dp, text


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def report_megatron(rep, recipe, cfg, total: int, *, hw: Hardware, rows: sm.Rows) -> Plan | None:
    """Memory by stage, bubble, traffic and step time of a Megatron recipe, added to `rep`; an error when
    the peak stage does not fit `hw.mem_gib` or the layout does not divide the model. Memory at the
    longest rows, time at the mean (recipes.planning.step_model.row_tokens)."""
    mg, tr, m = recipe.megatron, recipe.train, recipe.model
    lay, _ = layout_of(recipe)  # its own errors are megatron_layout's (section 5)
    try:
        shape = Shape.of(cfg)
    except AttributeError as err:
        rep.warnings.append(f"memory: no layer shapes in the model config ({err}); Megatron plan not estimated")
        return None
    problems = layout_problems(shape, lay, tr.grad_accum)
    rep.errors.extend(problems)
    if problems or lay.world != recipe.cluster.nodes * recipe.cluster.gpus_per_node or lay.gpus_per_node % lay.tp:
        return None
    seq = rows.peak
    gpu_mem_gb, gpu_tflops, gpu_peak_tflops = hw.mem_gib, hw.gpu_tflops, hw.peak_tflops
    net_gbps, nvlink_gbps = hw.net_gbps_per_gpu, hw.nvlink_gbps
    text = getattr(cfg, "text_config", None) or cfg
    tied = bool(getattr(text, "tie_word_embeddings", False))
    qkv_bias = bool(getattr(text, "attention_bias", False)) or getattr(text, "model_type", "") == "qwen2"
    e = 2 if m.dtype == "bfloat16" else 4
    pl = plan(shape, lay, micro_batch_size=tr.micro_batch_size, seq=seq, grad_accum=tr.grad_accum, tied=tied,
              recompute=mg.recompute, distributed_optimizer=mg.distributed_optimizer,
              overlap_grad_reduce=mg.overlap_grad_reduce, overlap_param_gather=mg.overlap_param_gather,
              chunked_head=recipe.loss.head == "chunked", chunk_size=recipe.loss.chunk_size, qkv_bias=qkv_bias,
              gpu_tflops=gpu_tflops, net_gbps=net_gbps, nvlink_gbps=nvlink_gbps, gpu_peak_tflops=gpu_peak_tflops, e=e)
    mean_seq = max(1, round(rows.mean))
    tpl = pl if mean_seq == seq else plan(
        shape, lay, micro_batch_size=tr.micro_batch_size, seq=mean_seq, grad_accum=tr.grad_accum, tied=tied,
        recompute=mg.recompute, distributed_optimizer=mg.distributed_optimizer,
        overlap_grad_reduce=mg.overlap_grad_reduce, overlap_param_gather=mg.overlap_param_gather,
        chunked_head=recipe.loss.head == "chunked", chunk_size=recipe.loss.chunk_size, qkv_bias=qkv_bias,
        gpu_tflops=gpu_tflops, net_gbps=net_gbps, nvlink_gbps=nvlink_gbps, gpu_peak_tflops=gpu_peak_tflops, e=e)
    peak = pl.peak
    first, last = pl.stages[0], pl.stages[-1]
    busiest = max(tpl.stages, key=lambda st: st.pp_inter + st.dp_inter)
    per_param = f"{2 + GRAD_BYTES} + 12/{lay.dp}" if mg.distributed_optimizer else "18"
    rep.numbers.update(gpu_mem_bytes=int(peak.memory["model states"]), gpu_total_bytes=int(peak.total),
                       activation_bytes=int(peak.memory["activations"]), head_bytes=int(last.memory["head"]),
                       first_stage_activation_bytes=int(first.memory["activations"]),
                       peak_stage=peak.index, bubble=tpl.bubble, step_time_s=tpl.step_s, mfu=tpl.mfu,
                       step_flops=tpl.stages[0].flops_mb * tr.grad_accum, model_flops=tpl.model_flops,
                       comm_inter_node_bytes=int(busiest.pp_inter + busiest.dp_inter),
                       comm_intra_node_bytes=int(busiest.tp_bytes + busiest.pp_intra + busiest.dp_intra))
    rep.add("memory / GPU (all)", f"peak stage {peak.index} of {lay.pp}: {_gib(peak.total)} = "
            + " + ".join(f"{k} {_gib(v)}" for k, v in peak.memory.items())
            + f"; model states {_gib(peak.memory['model states'])} = {peak.params / 1e9:.2f}B parameters x "
            f"({per_param}) bytes; {tr.micro_batch_size} x {seq} tokens per micro-batch at the longest rows")
    rep.add("tokens per row", rows.note)
    if lay.pp > 1:
        rep.add("memory by stage", ", ".join(f"{st.index}: {_gib(st.total)}" for st in pl.stages)
                + f" (first stage holds {layers_in_flight(lay, shape.layers, tr.grad_accum, 0):g} layer-micro-batches"
                f" of activations, last {layers_in_flight(lay, shape.layers, tr.grad_accum, lay.pp - 1):g})")
    rec = {None: "none", "selective": "selective", "full": "full"}
    other = "full" if mg.recompute != "full" else None
    alt = plan(shape, lay, micro_batch_size=tr.micro_batch_size, seq=seq, grad_accum=tr.grad_accum, tied=tied,
               recompute=other, chunked_head=recipe.loss.head == "chunked", qkv_bias=qkv_bias, e=e)
    rep.add("activations", f"{_gib(first.memory['activations'])} on the first stage with recompute "
                           f"{rec[mg.recompute]}; recompute {rec[other]} would make it "
                           f"{_gib(alt.stages[0].memory['activations'])}")
    rep.add("pipeline", f"{tr.grad_accum} micro-batches per step per DP rank, bubble {pl.bubble:.1%} of the step"
                        + (f" ((p-1)/v = {(lay.pp - 1) / lay.vpp:g} idle micro-batch slots)" if lay.pp > 1 else ""))
    rep.add("comm / GPU / step", f"stage {busiest.index}: {(busiest.pp_inter + busiest.dp_inter) / 1e9:,.2f} GB over "
            f"the network (PP {busiest.pp_inter / 1e9:,.2f} + DP {busiest.dp_inter / 1e9:,.2f}) + "
            f"{(busiest.tp_bytes + busiest.pp_intra + busiest.dp_intra) / 1e9:,.1f} GB over NVLink (TP"
            f"{' with SP' if lay.sp else ''} {busiest.tp_bytes / 1e9:,.1f} + PP {busiest.pp_intra / 1e9:,.2f} + DP "
            f"{busiest.dp_intra / 1e9:,.2f}); DP group {tpl.dp_ring}, PP group {tpl.pp_ring}; rank order tp-dp-pp "
            f"(megatron-core's default); grads reduced in fp32")
    pl = tpl  # time at the mean rows
    slow = max(pl.stages, key=lambda st: st.t_mb)
    rep.add("step time", f"{pl.step_s:.2f} s = ({tr.grad_accum} + {(lay.pp - 1) / lay.vpp:g}) x "
            f"{slow.t_mb * 1e3:.1f} ms per micro-batch on stage {slow.index} (compute {slow.t_compute * 1e3:.1f} ms"
            f" + TP {slow.t_tp * 1e3:.1f} ms + p2p {slow.t_p2p * 1e3:.2f} ms) + DP exposed "
            f"{max(st.t_dp_exposed for st in pl.stages) * 1e3:.1f} ms; {pl.tokens:,} tokens per step, "
            f"{pl.tokens / pl.step_s / lay.world:,.0f} tokens/s/GPU; MFU {pl.mfu:.1%}")
    rep.add("assumptions", f"{gpu_tflops:g} TFLOP/s achieved per GPU (--gpu-tflops), {gpu_peak_tflops:g} peak "
            f"(--gpu-peak-tflops), network {net_gbps:g} Gb/s per GPU ({hw.nics_per_node} x {hw.nic_gbps:g} Gb/s NICs "
            f"per node: --nics-per-node, --net-gbps), NVLink "
            f"{nvlink_gbps:g} Gb/s per GPU (--nvlink-gbps); TP not overlapped, p2p on the critical path, DP "
            f"overlapped with the last micro-batch's backward / the next first forward "
            f"(overlap_grad_reduce {mg.overlap_grad_reduce}, overlap_param_gather {mg.overlap_param_gather}); "
            f"fused attention; {FIXED_BUFFER_GIB:g} GiB fixed buffers (recipes/planning/megatron_budget.py)")
    if recipe.loss.head == "chunked":
        rep.warnings.append("loss.head: chunked: the Megatron engine computes the objective on GPTModel's "
                            "vocab-parallel logits (loss.head: logits); estimated with the chunked head as asked")
    if m.gradient_checkpointing:
        rep.warnings.append("model.gradient_checkpointing: not used by the Megatron engine; megatron.recompute is")
    if lay.pp > 1 and tr.grad_accum < lay.pp:
        rep.warnings.append(f"train.grad_accum: {tr.grad_accum} micro-batches for {lay.pp} pipeline stages: the "
                            f"bubble is {pl.bubble:.0%} of the step")
    if peak.total > gpu_mem_gb * GiB:
        big = max(peak.memory, key=peak.memory.get)
        rep.errors.append(f"memory: stage {peak.index} needs {_gib(peak.total)} per GPU, more than {gpu_mem_gb:g} GiB "
                          f"(--gpu-mem-gb): " + ", ".join(f"{k} {_gib(v)}" for k, v in peak.memory.items())
                          + f"; the largest part is {big}" + (
                              "; set megatron.recompute (selective, full) or megatron.sequence_parallel" if big ==
                              "activations" else "; more TP / PP, or megatron.distributed_optimizer"))
    return pl
