"""How fast one GPU runs a GEMM of a given shape: a small table of rates per GPU, interpolated, and the
per-kernel cost the step model adds. Sources and dates: docs/gemm-rates.md (the same numbers).

A transformer layer's GEMMs on one GPU are [M, K] x [K, N]: M = tokens per micro-batch, N and K the
tensor-parallel slice of the weight (QKV: K = h, N = (a + 2k) d / t; output projection: K = a d / t,
N = h; gate and up: K = h, N = 2 I / t; down: K = I / t, N = h). Backward runs each shape twice more,
the activation gradient [M, N] x [N, K] and the weight gradient [K, M] x [M, N], whose reduction runs
over the tokens. What sets a GEMM's efficiency is how much work it does per byte it moves and how well
its tiles fill the GPU, both of which fall as any one dimension gets small. The table is indexed by the
GEMM's arithmetic intensity, MNK / (MK + KN + MN) (FLOPs per byte of bf16 operands): symmetric in M, N
and K (so a GEMM and its two backward shapes share a rate), about M when M is the narrow dimension.

The measured points (`MEASURED`) are Llama-3-70B layer slices at tensor parallelism 8 on one H200
(forward and backward, TFLOP/s in kernels: attention, norms and the element-wise kernels included,
launch gaps not): 367, 317 and 161 at 4096, 1024 and 200 tokens per micro-batch (this project's issue
tracker, 2026-12). Each point sits at the slice's FLOP-weighted mean intensity. Between points the rate
is interpolated linearly in log intensity; below the smallest it falls in proportion to the intensity
(less work per byte read, the weights read all the same); above the largest it stays at the largest
measured rate (no faster shape was measured). H100 SXM: the H200's table (the same compute die; the
largest-shape matmul rates measured by ml-engineering's MAMF finder are equal, 794.5 TFLOP/s, and the
H200's extra HBM bandwidth does not limit these shapes). A100: the H200's table x 271.2 / 794.5, the
ratio of the two GPUs' MAMF (stas00/ml-engineering, compute/accelerator/README.md, 2026-08): derived, not
measured. Another GPU: the H200 table x its bf16 peak / 989. fp32 runs on TF32 tensor cores: half.

Per kernel: a launch and the gap before the next dependent kernel, KERNEL_OVERHEAD_S each (CUDA's launch
latency is a few microseconds; a guess, not measured here), x the kernels a layer runs per micro-batch,
forward and backward, which each engine's cost model states for its own layer (`KERNELS_PER_LAYER` in
recipes.engines.<engine>.costs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# (tokens per micro-batch of the reference slice, TFLOP/s in kernels): H200, Llama-3-70B layer at TP 8
MEASURED_H200 = ((200, 161.0), (1024, 317.0), (4096, 367.0))
# the reference slice: Llama-3-70B's layer at TP 8 (h, I, heads, KV heads, head dim, TP)
REFERENCE = (8192, 28672, 64, 8, 128, 8)
MAMF = {"H200": 794.5, "H100": 794.5, "A100": 271.2}  # largest-shape bf16 matmul, TFLOP/s (ml-engineering)
PEAK_BF16 = {"H200": 989.0, "H100": 989.0, "A100": 312.0}  # data sheets, dense
MEM_GIB = {"H200": 141.0, "H100": 80.0, "A100": 80.0}

KERNEL_OVERHEAD_S = 5e-6


def gemm_shapes(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, tp: int
                ) -> list[tuple[int, int]]:
    """(K, N) of one layer's forward GEMMs on one GPU of a TP group: QKV, output projection, gate + up,
    down (module docstring)."""
    return [(hidden, (heads + 2 * kv_heads) * head_dim // tp), (heads * head_dim // tp, hidden),
            (hidden, 2 * intermediate // tp), (intermediate // tp, hidden)]


def intensity(m: float, n: float, k: float) -> float:
    """A GEMM's FLOPs per byte of bf16 operands: 2 M N K / (2 (M K + K N + M N))."""
    return m * n * k / (m * k + k * n + m * n)


def layer_intensity(tokens: float, shapes: list[tuple[int, int]]) -> float:
    """The FLOP-weighted mean intensity of a layer's GEMMs at `tokens` per micro-batch."""
    work = [k * n for k, n in shapes]
    return sum(w * intensity(tokens, n, k) for w, (k, n) in zip(work, shapes)) / sum(work)


_REF_SHAPES = gemm_shapes(*REFERENCE)
ANCHORS_H200 = tuple((layer_intensity(m, _REF_SHAPES), rate) for m, rate in MEASURED_H200)


@dataclass(frozen=True)
class RateTable:
    """TFLOP/s by arithmetic intensity for one GPU (module docstring); `scale` multiplies every rate."""

    gpu: str
    anchors: tuple[tuple[float, float], ...]
    note: str

    def tflops(self, ai: float) -> float:
        (x0, r0), (x1, r1) = self.anchors[0], self.anchors[-1]
        if ai <= x0:
            return r0 * ai / x0
        if ai >= x1:
            return r1
        for (xa, ra), (xb, rb) in zip(self.anchors, self.anchors[1:]):
            if ai <= xb:
                return ra + (rb - ra) * math.log(ai / xa) / math.log(xb / xa)
        raise AssertionError("unreachable")

    def scaled(self, factor: float, note: str) -> "RateTable":
        return RateTable(self.gpu, tuple((x, r * factor) for x, r in self.anchors), note)

    @property
    def plateau(self) -> float:
        return self.anchors[-1][1]


H200 = RateTable("H200", ANCHORS_H200, "H200: measured (Llama-3-70B TP-8 layer slices, 2026-12)")


def gpu_name(text: str | None, peak: float | None = None, mem_gib: float | None = None) -> str:
    """The table's name for a GPU named `text` (a cluster.gpu value or torch's device name), else a
    guess from its peak and memory (989 TFLOP/s: H200 with 141 GiB, else H100; 312: A100); "" if none."""
    for key in ("H200", "H100", "A100"):
        if text and key.lower() in text.lower():
            return key
    if text:
        return ""
    if peak == 989.0:
        return "H200" if mem_gib and mem_gib > 100 else "H100"
    if peak == 312.0:
        return "A100"
    return ""


def rate_table(gpu: str, peak_tflops: float, dtype: str = "bfloat16", plateau: float | None = None) -> RateTable:
    """The GEMM rate table a plan uses (module docstring): the GPU's, scaled to `plateau` (the rate at
    the largest shapes: --gpu-tflops / cluster.gpu_tflops) when given, halved for fp32 (TF32)."""
    if gpu == "H200" or gpu == "H100":
        table = H200 if gpu == "H200" else H200.scaled(1.0, "H100: the H200's (same die, same MAMF), derived")
    elif gpu == "A100":
        table = H200.scaled(MAMF["A100"] / MAMF["H200"], "A100: H200 x 271.2/794.5 (MAMF ratio), derived")
    else:
        table = H200.scaled(peak_tflops / PEAK_BF16["H200"], f"{peak_tflops:g} TFLOP/s peak: H200 x peak/989, derived")
    if plateau:
        table = table.scaled(plateau / table.plateau, f"{table.note}, scaled to {plateau:g} at the largest shapes "
                                                      f"(--gpu-tflops)")
    if dtype == "float32":
        table = table.scaled(0.5, table.note + "; fp32 on TF32: half")
    return table


def layer_gemm_seconds(table: RateTable, tokens: float, shapes: list[tuple[int, int]]) -> tuple[float, float]:
    """(seconds, FLOPs) of one layer's GEMMs, forward and both backward GEMMs, at `tokens` per micro-batch
    on one GPU: each shape's 6 M N K FLOPs at its own rate."""
    seconds = flops = 0.0
    for k, n in shapes:
        f = 6.0 * tokens * n * k
        seconds += f / (table.tflops(intensity(tokens, n, k)) * 1e12)
        flops += f
    return seconds, flops
