"""The step-time arithmetic both engines share: the hardware a recipe assumes, where a collective's bytes
go (NVLink inside the node, NICs across nodes), compute time, MFU, the GPU peak table, and the tokens
per row a plan counts. recipes.planning.budget (DeepSpeed), recipes.planning.megatron_budget and the run
log (recipes.training.throughput) build on it; nothing here has been measured on a GPU.

Where a ring collective's bytes go. A ring all-gather or reduce-scatter over n ranks sends (n - 1)/n of
the whole buffer from every rank, an all-reduce twice that ("ring bytes"). A group with g ranks on each of
N > 1 nodes, ranks ordered by node, leaves and enters each node once per NCCL channel; the channels
spread over the node's NICs. So of a GPU's ring bytes, 1/g crosses the network and (g - 1)/g stays on
NVLink; a node sends (ranks per node / g) x ring bytes over the network in all (each of its groups
once), at NICs per node x NIC bandwidth. A collective takes the longer of its network and NVLink parts
(they run at once, pipelined); collectives of one step are added (they share the links).

Compute: model FLOPs per token 6 N + 6 s a d L (N: the layers' and the output layer's matmul weights,
not the input embedding; causal attention over rows of s tokens: fused kernels skip the masked half),
at an achievable rate (--gpu-tflops, 400: ~40 % of an H100's bf16 peak); recompute adds its forward.
MFU = model FLOPs (no recompute) / (step time x GPUs x peak), the peak of the GPU's dense bf16 (TF32 for
fp32 runs) from GPU_PEAKS_BF16 by device name, or --gpu-peak-tflops.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

GiB = 2**30
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

    gpu_tflops: float = 400.0  # achieved per GPU
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

    def compute_s(self, flops: float) -> float:
        return flops / (self.gpu_tflops * 1e12)


def hardware(recipe, **flags) -> Hardware:
    """The recipe's hardware: validate's flags (not None) first, then the recipe's cluster.* settings,
    then the defaults of Hardware. nics_per_node defaults to one per GPU."""
    c = recipe.cluster
    gpus = c.gpus_per_node or 8
    values = {"gpu_tflops": c.gpu_tflops, "peak_tflops": c.gpu_peak_tflops, "nic_gbps": c.nic_gbps,
              "nics_per_node": c.nics_per_node or gpus, "nvlink_gbps": c.nvlink_gbps, "mem_gib": c.gpu_mem_gb}
    values.update({k: v for k, v in flags.items() if v is not None})
    return Hardware(gpus_per_node=gpus, **{k: v for k, v in values.items() if v is not None})


# ---- collectives ---------------------------------------------------------------------------------------


def ring_bytes(kind: str, buffer_bytes: float, n: int) -> float:
    """Bytes one rank sends in a ring `kind` ("all_gather", "reduce_scatter", "all_reduce") of a buffer
    of `buffer_bytes` (the whole gathered / reduced tensor) over n ranks."""
    if n <= 1:
        return 0.0
    return buffer_bytes * (n - 1) / n * (2 if kind == "all_reduce" else 1)


@dataclass
class Collective:
    """One kind of collective of a step on one GPU: its ring bytes summed over the step's calls, and
    where its group sits (nodes it spans, its ranks on one node)."""

    name: str
    ring: float
    nodes: int = 1
    per_node: int = 1
    calls: int = 1

    @property
    def net(self) -> float:
        """Bytes this GPU sends over the network (module docstring)."""
        return self.ring / self.per_node if self.nodes > 1 else 0.0

    @property
    def nvl(self) -> float:
        return self.ring - self.net

    def net_s(self, hw: Hardware) -> float:
        return self.net * hw.gpus_per_node / hw.node_net_Bps if self.net else 0.0

    def nvl_s(self, hw: Hardware) -> float:
        return self.nvl / hw.nvlink_Bps

    def time(self, hw: Hardware) -> float:
        return max(self.net_s(hw), self.nvl_s(hw))

    def bound(self, hw: Hardware) -> str:
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


def mfu(model_flops: float, step_s: float, gpus: int, hw: Hardware) -> float:
    return model_flops / (step_s * gpus * hw.peak_tflops * 1e12) if step_s > 0 else 0.0


# ---- tokens per row --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rows:
    """Tokens per row a plan counts: `mean` for compute and traffic, `peak` for memory, and whence."""

    mean: float
    peak: int
    note: str


ASSUMED_ROW_TOKENS = 1024


def row_tokens(recipe, seq_len: int | None = None, mean_tokens: float | None = None) -> Rows:
    """--seq-len (rows of exactly that many tokens), else data.seq_len (every batch padded to it), else the
    data's manifest (mean = its tokens / rows, peak = its build's max_length or pack length), else the
    stated assumption of ASSUMED_ROW_TOKENS. `mean_tokens` (--mean-row-tokens) replaces the mean alone."""
    if seq_len:
        rows = Rows(seq_len, seq_len, f"{seq_len} tokens per row (--seq-len)")
    elif recipe.data.seq_len:
        rows = Rows(recipe.data.seq_len, recipe.data.seq_len, f"{recipe.data.seq_len} tokens per row (data.seq_len)")
    else:
        rows = _manifest_rows(recipe.data.train) or Rows(
            ASSUMED_ROW_TOKENS, ASSUMED_ROW_TOKENS, f"{ASSUMED_ROW_TOKENS} tokens per row ASSUMED (no data at "
            f"data.train, no data.seq_len; --seq-len, --mean-row-tokens)")
    if mean_tokens:
        rows = Rows(mean_tokens, max(rows.peak, int(mean_tokens)), rows.note + f"; mean {mean_tokens:g} (--mean-row-tokens)")
    return rows


def _manifest_rows(path: str) -> Rows | None:
    p = Path(path or "") / "manifest.json"
    if not path or not p.is_file():
        return None
    man = json.loads(p.read_text())
    totals = man.get("totals", {})
    if not totals.get("rows"):
        return None
    mean = totals["tokens"] / totals["rows"]
    cfg = man.get("config", {})
    peak = (cfg.get("shards") or {}).get("pack_length") or (cfg.get("tokenize") or {}).get("max_length") or int(mean)
    return Rows(mean, int(peak), f"mean {mean:,.0f} / max {peak} tokens per row (the manifest of {path})")
