"""The step-time arithmetic every engine shares: the hardware a recipe assumes, where a collective's bytes
go (NVLink inside the node, NICs across nodes) and how long a collective takes, a micro-batch's compute
time on one GPU, MFU, the GPU peak table, and the rows a plan counts. The engines' cost
models (recipes.engines.<engine>.costs) and the run log (recipes.training.throughput) build on it.
Its terms, their sources and what it cannot know: docs/benchmarks.md ("The step model").

Where a ring collective's bytes go. A ring all-gather or reduce-scatter over n ranks sends (n - 1)/n of
the whole buffer from every rank, an all-reduce twice that ("ring bytes"). A group with g ranks on each of
N > 1 nodes, ranks ordered by node, leaves and enters each node once per NCCL channel; the channels
spread over the node's NICs. So of a GPU's ring bytes, 1/g crosses the network and (g - 1)/g stays on
NVLink; a node sends (ranks per node / g) x ring bytes over the network in all (each of its groups
once), at NICs per node x NIC bandwidth. Collectives of one step are added (they share the links).

How long one collective call takes (alpha-beta, NCCL's own cost model: src/graph/tuning.cc of NCCL
2.30.7, 2026-06): for each protocol p (LL, LL128, Simple) a latency base_p + (steps - inter) x
hop_p(NVLink) + inter x hop_p(network), steps = n - 1 ring steps (2 (n - 1) for an all-reduce) of which
inter = N - 1 (2 (N - 1)) cross nodes, plus the longer of its network and NVLink bytes over their
bandwidth x the protocol's share of it (LL 1/2, LL128 0.92, Simple 1); NCCL picks the fastest protocol,
so does this. A pipeline p2p send: one Simple hop (base + NVLink or network hop) + its bytes.

Compute of one micro-batch on one GPU (`micro_batch_compute`): each GEMM of a layer at its own rate
(recipes.planning.gemm_rates: a table by GPU, interpolated by the GEMM's shape), causal attention
(6 s a d / t FLOPs per token per layer, s the padded row length: fused kernels skip the masked half) at
the layer's GEMM rate, a per-kernel overhead x the kernels a layer runs, and the output layer's GEMM;
recompute adds the forward again (full: GEMMs, attention and kernels; selective: attention). The
padded tokens are what runs: recipes.planning.padding deals the data's rows as the engine pads them.
MFU = model FLOPs of the real tokens (6 N per token + 6 a d L per token per row's length, no recompute,
no padding) / (predicted step time x GPUs x peak): derived from the time, never assumed. The peak is
the GPU's dense bf16 (TF32 for fp32 runs) from GPU_PEAKS_BF16 by device name, or --gpu-peak-tflops.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from recipes.planning import gemm_rates
from recipes.planning.padding import Deal, deal, shard_row_lengths

GiB = 2**30


def gib(n_bytes: float) -> str:
    return f"{n_bytes / GiB:.1f} GiB"
FIXED_BUFFER_GIB = 2.0  # CUDA context, NCCL communicators, cuBLAS workspaces, allocator slack (a guess)

# Dense (no sparsity) bf16 tensor-core peak per GPU, TFLOP/s, from NVIDIA's data sheets; matched as
# substrings of torch.cuda.get_device_name(), first match wins (so the more specific names come first).
# fp32 training runs on TF32 tensor cores: half of these on A100 / H100 / H200 / B200.
GPU_PEAKS_BF16: tuple[tuple[str, float], ...] = (
    ("GH200", 989.0), ("GB200", 2500.0), ("B200", 2250.0), ("B100", 1750.0),
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200", 989.0), ("H100", 989.0), ("H800", 989.0), ("H20", 148.0),
    ("A100", 312.0), ("A800", 312.0), ("A30", 165.0), ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0),
)


def peak_tflops(device_name: str, dtype: str = "bfloat16") -> float | None:
    """The GPU's dense peak for `dtype` (bfloat16; float32 runs on TF32: half), None when unknown."""
    for key, tflops in GPU_PEAKS_BF16:
        if key.lower() in device_name.lower():
            return tflops if dtype != "float32" else tflops / 2
    return None


@dataclass(frozen=True)
class Hardware:
    """What a plan assumes about each GPU and node (cluster.* in the recipe, or validate's flags)."""

    gpu: str = ""  # the GEMM rate table's GPU (gemm_rates.gpu_name; "": guessed from peak and memory)
    gpu_tflops: float | None = None  # the GEMM rate at the largest shapes (None: the GPU's table as it is)
    peak_tflops: float = 989.0  # for MFU (H100 SXM, bf16 dense)
    nic_gbps: float = 400.0  # one NIC (NDR InfiniBand)
    nics_per_node: int = 8
    nvlink_gbps: float = 2880.0  # per GPU, NCCL's bus bandwidth inside an 8 x H100 SXM node (360 GB/s)
    gpus_per_node: int = 8
    mem_gib: float = 80.0

    @property
    def node_net_Bps(self) -> float:
        return self.nics_per_node * self.nic_gbps / 8 * 1e9

    @property
    def net_gbps_per_gpu(self) -> float:
        """The node's NIC bandwidth shared by its GPUs (400 with one 400 Gb/s NIC per GPU)."""
        return self.nics_per_node * self.nic_gbps / max(1, self.gpus_per_node)

    @property
    def nvlink_Bps(self) -> float:
        return self.nvlink_gbps / 8 * 1e9

    def rates(self, dtype: str = "bfloat16") -> gemm_rates.RateTable:
        """The GEMM rates this GPU runs at (recipes.planning.gemm_rates)."""
        name = gemm_rates.gpu_name(self.gpu or None, self.peak_tflops, self.mem_gib)
        return gemm_rates.rate_table(name, self.peak_tflops, dtype, self.gpu_tflops)


def hardware(recipe, **flags) -> Hardware:
    """The recipe's hardware: validate's flags (not None) first, then the recipe's cluster.* settings,
    then the named GPU's peak and memory (cluster.gpu / --gpu), then the defaults of Hardware.
    nics_per_node defaults to one per GPU."""
    c = recipe.cluster
    gpus = c.gpus_per_node or 8
    named = flags.get("gpu") or c.gpu
    gpu = gemm_rates.gpu_name(named)
    values = {"gpu": named, "gpu_tflops": c.gpu_tflops,
              "peak_tflops": c.gpu_peak_tflops or gemm_rates.PEAK_BF16.get(gpu), "nic_gbps": c.nic_gbps,
              "nics_per_node": c.nics_per_node or gpus, "nvlink_gbps": c.nvlink_gbps,
              "mem_gib": c.gpu_mem_gb or gemm_rates.MEM_GIB.get(gpu)}
    values.update({k: v for k, v in flags.items() if v is not None})
    return Hardware(gpus_per_node=gpus, **{k: v for k, v in values.items() if v is not None})


# ---- collectives ---------------------------------------------------------------------------------------


def ring_bytes(kind: str, buffer_bytes: float, n: int) -> float:
    """Bytes one rank sends in a ring `kind` ("all_gather", "reduce_scatter", "all_reduce") of a buffer
    of `buffer_bytes` (the whole gathered / reduced tensor) over n ranks."""
    if n <= 1:
        return 0.0
    return buffer_bytes * (n - 1) / n * (2 if kind == "all_reduce" else 1)


# NCCL 2.30.7's tuner constants (src/graph/tuning.cc): ring latencies in microseconds per protocol
NCCL_BASE_US = {"LL": 6.6, "LL128": 14.0, "Simple": 8.4}
NCCL_HOP_US = {"nvlink": {"LL": 0.6, "LL128": 1.9, "Simple": 3.4}, "net": {"LL": 2.7, "LL128": 4.0, "Simple": 14.0}}
NCCL_BW_SHARE = {"LL": 0.5, "LL128": 0.92, "Simple": 1.0}  # of the bus bandwidth


def latency_s(kind: str, ranks: int, nodes: int, protocol: str) -> float:
    """NCCL's latency of one ring collective (or a p2p send) over `ranks` ranks on `nodes` nodes."""
    if kind == "p2p":
        return (NCCL_BASE_US["Simple"] + NCCL_HOP_US["net" if nodes > 1 else "nvlink"]["Simple"]) * 1e-6
    if ranks <= 1:
        return 0.0
    per = 2 if kind == "all_reduce" else 1
    steps, inter = per * (ranks - 1), per * (max(1, nodes) - 1)
    hop = NCCL_HOP_US
    return (NCCL_BASE_US[protocol] + (steps - inter) * hop["nvlink"][protocol] + inter * hop["net"][protocol]) * 1e-6


@dataclass
class Collective:
    """One kind of collective of a step on one GPU: its ring bytes summed over the step's `calls`, the
    collective `kind` ("all_gather", "reduce_scatter", "all_reduce", "p2p"), and where its group sits
    (`ranks` in it, the nodes it spans, its ranks on one node). `ranks` 0: bandwidth only, no latency.
    `parts`: NCCL calls per listed call (ZeRO-3 gathers a layer at a time, reduces a bucket at a time);
    each pays the latency."""

    name: str
    ring: float
    nodes: int = 1
    per_node: int = 1
    calls: int = 1
    kind: str = "all_gather"
    ranks: int = 0
    parts: int = 1

    @property
    def messages(self) -> int:
        return self.calls * self.parts

    @property
    def net(self) -> float:
        """Bytes this GPU sends over the network (module docstring); an all-to-all ("all_to_all", `ring`:
        the bytes it sends to the group's other ranks, an equal share each) sends the shares of the ranks
        on other nodes, (n - g) / (n - 1) of them."""
        if self.nodes <= 1:
            return 0.0
        if self.kind == "all_to_all":
            n = max(self.ranks, self.nodes * self.per_node)
            return self.ring * (n - self.per_node) / (n - 1)
        return self.ring / self.per_node

    @property
    def nvl(self) -> float:
        return self.ring - self.net

    def net_s(self, hw: Hardware) -> float:
        return self.net * hw.gpus_per_node / hw.node_net_Bps if self.net else 0.0

    def nvl_s(self, hw: Hardware) -> float:
        return self.nvl / hw.nvlink_Bps

    def bandwidth_s(self, hw: Hardware) -> float:
        """The step's calls' bytes at full bus bandwidth: the longer of the network and NVLink parts."""
        return max(self.net_s(hw), self.nvl_s(hw))

    def _call_latency(self, protocol: str) -> float:
        if self.kind != "p2p" and not self.ranks:
            return 0.0
        return latency_s(self.kind, self.ranks, self.nodes, protocol)

    def _protocol(self, hw: Hardware) -> tuple[str, float]:
        """The protocol NCCL would pick for one call, and that call's seconds."""
        per_call = self.bandwidth_s(hw) / max(1, self.messages)
        protocols = ("Simple",) if self.kind == "p2p" or not self.ranks else tuple(NCCL_BASE_US)
        times = {p: self._call_latency(p) + per_call / NCCL_BW_SHARE[p] for p in protocols}
        best = min(times, key=times.get)
        return best, times[best]

    def time(self, hw: Hardware) -> float:
        """All calls of the step: messages x (latency + bytes / bandwidth) at the fastest protocol."""
        if self.calls <= 0 or (self.ring <= 0 and self.kind != "p2p"):
            return 0.0
        return self.messages * self._protocol(hw)[1]

    def latency_s(self, hw: Hardware) -> float:
        """The latency part of `time`."""
        if self.calls <= 0 or (self.ring <= 0 and self.kind != "p2p"):
            return 0.0
        return self.messages * self._call_latency(self._protocol(hw)[0])

    def bound(self, hw: Hardware) -> str:
        if self.latency_s(hw) > self.time(hw) / 2:
            return "latency"
        return "network" if self.net_s(hw) >= self.nvl_s(hw) else "NVLink"


def split_ring(ring: float, nodes: int, per_node: int) -> tuple[float, float]:
    """(network, NVLink) bytes of one GPU's ring bytes over a group spanning `nodes` nodes, `per_node`
    ranks on each."""
    c = Collective("", ring, nodes, per_node)
    return c.net, c.nvl


def comm_time(collectives: list[Collective], hw: Hardware) -> float:
    return sum(c.time(hw) for c in collectives)


def slowest(collectives: list[Collective], hw: Hardware) -> Collective | None:
    return max(collectives, key=lambda c: c.time(hw), default=None)


# ---- compute -------------------------------------------------------------------------------------------


def layer_matmul_params(s) -> int:
    """One decoder layer's weight-matrix parameters (q, k, v, o, gate, up, down), all TP ranks."""
    attn = s.hidden * (s.heads + 2 * s.kv_heads) * s.head_dim + s.heads * s.head_dim * s.hidden
    return attn + 3 * s.hidden * s.intermediate


def matmul_params(s) -> int:
    """N of 6 N T: every layer's matrices and the output layer (the input embedding is a lookup)."""
    return s.layers * layer_matmul_params(s) + s.vocab * s.hidden


def attention_flops_per_token(s, seq: float) -> float:
    """Causal attention's FLOPs per token over rows of `seq` tokens, forward and backward, all layers."""
    return 6 * seq * s.heads * s.head_dim * s.layers


def model_flops_per_token(s, seq: float) -> float:
    """6 N + 6 s a d L (module docstring)."""
    return 6 * matmul_params(s) + attention_flops_per_token(s, seq)


def model_flops(s, tokens: float, square_tokens: float) -> float:
    """Model FLOPs of rows holding `tokens` real tokens whose lengths' squares add up to `square_tokens`:
    6 N per token + causal attention's 6 a d L per token per row length (module docstring)."""
    return 6 * matmul_params(s) * tokens + 6 * s.heads * s.head_dim * s.layers * square_tokens


def mfu(model_flops: float, step_s: float, gpus: int, hw: Hardware) -> float:
    return model_flops / (step_s * gpus * hw.peak_tflops * 1e12) if step_s > 0 else 0.0


@dataclass(frozen=True)
class Compute:
    """One micro-batch on one GPU: seconds by part, and the FLOPs it executes (recompute included)."""

    gemm_s: float
    attention_s: float
    kernels_s: float
    head_s: float
    flops: float

    @property
    def seconds(self) -> float:
        return self.gemm_s + self.attention_s + self.kernels_s + self.head_s

    @property
    def rate(self) -> float:
        """The TFLOP/s its GEMMs and attention run at."""
        work = self.gemm_s + self.attention_s + self.head_s
        return self.flops / work / 1e12 if work else 0.0


def micro_batch_compute(s, *, rows: int, length: int, tp: int, layers: float, hw: Hardware, kernels_per_layer: int,
                        dtype: str = "bfloat16", recompute: str | None = None, head: bool = False,
                        head_gemms: float = 3.0, weight_grads: bool = True, mlp: bool = True) -> Compute:
    """One micro-batch of `rows` rows padded to `length` tokens through `layers` decoder layers (and the
    output layer when `head`) on one GPU of a TP group of `tp` (module docstring). `kernels_per_layer`
    the kernels a layer runs (forward and backward: the engine's cost model says); `recompute` None, "selective" (the
    attention again) or "full" (the layer's forward again); `head_gemms` the output layer's GEMMs (3:
    forward and both gradients; the chunked head recomputes the logits: 4; a frozen head: 2);
    `weight_grads` False: a frozen base (LoRA), no weight-gradient GEMMs; `mlp` False: the layers' MLP GEMMs
    left out (an MoE model's experts are priced by recipes.planning.moe)."""
    table = hw.rates(dtype)
    tokens = rows * length
    shapes = gemm_rates.gemm_shapes(s.hidden, s.intermediate, s.heads, s.kv_heads, s.head_dim, tp)[:None if mlp else 2]
    gemm_s, gemm_f = gemm_rates.layer_gemm_seconds(table, tokens, shapes)
    forward_s, forward_f = gemm_s / 3, gemm_f / 3  # one of the three GEMMs per shape, at the same rate
    if not weight_grads:
        gemm_s, gemm_f = 2 * forward_s, 2 * forward_f
    attn_f = 6.0 * length * s.heads * s.head_dim * tokens / tp
    attn_s = attn_f * gemm_s / gemm_f  # at the layer's GEMM rate
    kernels_s = kernels_per_layer * gemm_rates.KERNEL_OVERHEAD_S
    if recompute == "full":
        gemm_s, gemm_f = gemm_s + forward_s, gemm_f + forward_f
        attn_s, attn_f, kernels_s = attn_s * 4 / 3, attn_f * 4 / 3, kernels_s * 4 / 3
    elif recompute == "selective":
        attn_s, attn_f = attn_s * 4 / 3, attn_f * 4 / 3
    head_s = head_f = 0.0
    if head:
        n = s.vocab / tp
        head_f = 2.0 * tokens * n * s.hidden * head_gemms
        head_s = head_f / (table.tflops(gemm_rates.intensity(tokens, n, s.hidden)) * 1e12)
    return Compute(layers * gemm_s, layers * attn_s, layers * kernels_s, head_s,
                   layers * (gemm_f + attn_f) + head_f)


@dataclass(frozen=True)
class StepWork:
    """A step's micro-batch work on the critical path (`price`): seconds, the mean seconds per step of each
    term, the FLOPs one GPU executes per step, the typical micro-batch's GEMM rate (TFLOP/s)."""

    seconds: float
    parts: dict
    flops: float
    rate: float


def price(dealt: Deal, cost) -> StepWork:
    """The step's micro-batch work: `cost(tokens)` -> ({term: seconds}, FLOPs, TFLOP/s) of one micro-batch
    of `tokens` (padding included), summed over the micro-batches on the step's critical path (`dealt`:
    recipes.planning.padding). Each term is the mean micro-batch's x the micro-batches of a rank; what
    the critical path adds over that (the slowest rank's longer micro-batches) is its own term."""
    values = np.unique(np.concatenate([s.values for s in dealt.critical] + [dealt.typical.values]))
    costs = {int(v): cost(int(v)) for v in values}
    total = {v: sum(parts.values()) for v, (parts, _, _) in costs.items()}

    def expected(slots, f) -> float:
        return slots.count * float(sum(p * f(int(v)) for v, p in zip(slots.values, slots.probs) if p > 0))

    seconds = sum(expected(slots, total.get) for slots in dealt.critical)
    m = sum(slots.count for slots in dealt.critical)
    parts: dict[str, float] = {}
    for v, p in zip(dealt.typical.values, dealt.typical.probs):
        for k, x in costs[int(v)][0].items():
            parts[k] = parts.get(k, 0.0) + m * p * x
    wait = seconds - sum(parts.values())
    if wait > 1e-9 * seconds:
        parts["waiting for the slowest rank"] = wait
    flops = m * expected(dealt.typical, lambda v: costs[v][1])
    return StepWork(seconds, parts, flops, costs[dealt.typical.median][2])


def dominant_terms(parts: dict, step_s: float, n: int = 4) -> str:
    """The largest terms of a step, with their share of it: what the step time is made of."""
    ordered = sorted(((k, v) for k, v in parts.items() if v > 0), key=lambda kv: -kv[1])
    return ", ".join(f"{k} {v * 1e3:,.0f} ms ({v / step_s:.0%})" for k, v in ordered[:n]) if step_s else ""


def assumptions(hw: Hardware, dtype: str) -> str:
    """The hardware figures a plan used, each with the flag or key that changes it."""
    table = hw.rates(dtype)
    return (f"GEMM rates {table.note} ({', '.join(f'{r:.0f}' for _, r in table.anchors)} TFLOP/s at the measured "
            f"shapes; --gpu, --gpu-tflops), {gemm_rates.KERNEL_OVERHEAD_S * 1e6:g} us per kernel launch, {hw.peak_tflops:g} "
            f"TFLOP/s peak for MFU (--gpu-peak-tflops), {hw.nics_per_node} x {hw.nic_gbps:g} Gb/s NICs per node "
            f"(--nics-per-node, --net-gbps), NVLink {hw.nvlink_gbps:g} Gb/s per GPU (--nvlink-gbps), NCCL 2.30's "
            f"latencies; docs/gemm-rates.md")


# ---- rows ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rows:
    """The rows a plan counts: `peak` tokens for memory; for time, `lengths` (a sample of the data's real
    row lengths; None: every row `mean` tokens) dealt and padded as the engine does (`deal`): every row
    to `fixed` (data.seq_len) or each micro-batch to its longest, rounded up to `pad_multiple`, sorted
    first with `bucketing` (data.length_bucketing). `note` says whence."""

    mean: float
    peak: int
    note: str
    lengths: np.ndarray | None = field(default=None, compare=False, repr=False)
    fixed: int | None = None
    bucketing: bool = False
    pad_multiple: int = 1

    def deal(self, micro_batch: int, micro_batches: int, dp: int, repad: int | None = None, lockstep: bool = False,
             one_length: bool = False, concat: bool = False) -> Deal:
        """The micro-batches of a step at this layout (recipes.planning.padding), as the loop's batches
        come (each padded to its longest row rounded up to data.pad_to_multiple_of, or to data.seq_len),
        or with `repad` as the Megatron engine prepares them: each cut at its last real column and
        rounded up to `repad` (lcm of data.pad_to_multiple_of and, under SP, the TP size), data.seq_len's
        padding dropped; `concat` with it: the rows' real tokens back to back (THD, Transformer Engine);
        `lockstep`: the ranks meet at every micro-batch (ZeRO-2/3); `one_length`: a rank's
        micro-batches all padded to one length (interleaved 1F1B)."""
        lengths = self.lengths if self.lengths is not None else np.array([max(1, round(self.mean))])
        return deal(lengths, micro_batch=micro_batch, micro_batches=micro_batches, dp=dp, bucketing=self.bucketing,
                    pad_multiple=repad or self.pad_multiple, fixed=None if repad else self.fixed, lockstep=lockstep,
                    one_length=one_length, concat=concat and bool(repad))


ASSUMED_ROW_TOKENS = 1024


def row_tokens(recipe, seq_len: int | None = None, mean_tokens: float | None = None) -> Rows:
    """--seq-len (rows of exactly that many tokens), else the data's rows: their lengths read from the
    shards of data.train, padded to data.seq_len when it is set, else each micro-batch to its longest;
    without data, every row data.seq_len or the stated assumption of ASSUMED_ROW_TOKENS. `mean_tokens`
    (--mean-row-tokens): rows of exactly that many tokens for time; memory keeps the data's peak."""
    d = recipe.data
    common = {"bucketing": d.length_bucketing, "pad_multiple": d.pad_to_multiple_of}
    found = Rows(seq_len, seq_len, f"{seq_len} tokens per row (--seq-len)", np.array([seq_len])) if seq_len \
        else _data_rows(d.train)
    if mean_tokens:
        peak = max(found.peak if found else d.seq_len or ASSUMED_ROW_TOKENS, int(mean_tokens))
        whence = found.note if found else f"peak {peak}"
        return Rows(mean_tokens, peak, f"{whence}; rows of {mean_tokens:g} tokens for time (--mean-row-tokens)",
                    np.array([round(mean_tokens)]), fixed=d.seq_len, **common)
    if seq_len:
        return Rows(seq_len, seq_len, found.note, found.lengths, **common)
    if d.seq_len:
        lengths = found.lengths if found else np.array([d.seq_len])
        real = found.note if found else "no data at data.train: the rows' real lengths unknown"
        return Rows(float(lengths.mean()), d.seq_len, f"every row padded to {d.seq_len} tokens (data.seq_len); {real}",
                    lengths, fixed=d.seq_len, **common)
    if found:
        return Rows(found.mean, found.peak, found.note, found.lengths, **common)
    return Rows(ASSUMED_ROW_TOKENS, ASSUMED_ROW_TOKENS, f"{ASSUMED_ROW_TOKENS} tokens per row ASSUMED (no data at "
                f"data.train, no data.seq_len; --seq-len, --mean-row-tokens)", np.array([ASSUMED_ROW_TOKENS]), **common)


def _data_rows(path: str) -> Rows | None:
    """The row lengths of the data at `path` (recipes.planning.padding.shard_row_lengths); peak: the
    longest row, from the manifest's per-shard statistics (data_prep/stats.py) or from the rows when
    every row was read, else the build's max_length or pack length."""
    import json
    from pathlib import Path

    found = shard_row_lengths(path)
    if found is None:
        return None
    lengths, complete = found
    manifest = json.loads((Path(path) / "manifest.json").read_text())
    cfg = manifest.get("config", {})
    cap = (cfg.get("shards") or {}).get("pack_length") or (cfg.get("tokenize") or {}).get("max_length")
    longest = [((shard.get("stats") or {}).get("tokens_max") or {}).get("value") for shard in manifest["shards"]]
    if all(isinstance(n, int) for n in longest) and longest:
        peak = max(longest)
    else:
        peak = int(lengths.max()) if complete or not cap else int(cap)
    p50, p90 = np.percentile(lengths, [50, 90])
    return Rows(float(lengths.mean()), peak, f"rows of {lengths.mean():,.0f} tokens on average (median {p50:.0f}, "
                f"90th percentile {p90:.0f}, longest {int(lengths.max())}; {len(lengths):,} rows "
                f"{'' if complete else 'sampled '}from the shards of {path}), peak {peak}", lengths)
