"""The step model (recipes.planning.step_model, gemm_rates, padding) against a hand model written out here,
term by term, at 200, 1024 and 4096 tokens per row for Llama-3-8B and -70B on both engines, and its
parts against hand-worked cases: the GEMM rate table, NCCL's alpha-beta collectives, the expected
padding of dealt micro-batches, MFU from the predicted time.

The hand model is coarser than the model on purpose, so the two are not the same arithmetic twice: it
prices a whole layer at the rate measured for a Llama-3-70B TP-8 layer slice on an H200 at the
micro-batch's token count (161, 317, 367 TFLOP/s at 200, 1024, 4096 tokens; one row per micro-batch, so
the tokens are the row's), where the model prices each GEMM at its own shape's rate. Everything else it
adds up by hand from the layouts' own numbers. The model must land within 20 % of it; the table the test
prints is docs/benchmarks.md's ("The step model against the hand model").
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from recipes.planning import gemm_rates
from recipes.planning import padding
from recipes.planning import step_model
from recipes.validation import validate

CONFIGS = Path(__file__).resolve().parents[3] / "recipes" / "configs"
MEASURED = {200: 161e12, 1024: 317e12, 4096: 367e12}  # FLOP/s in kernels, H200, TP-8 70B slice (2026-12)
NVLINK, NIC = 360e9, 50e9  # bytes/s: NCCL's bus bandwidth on 8 x H100 SXM; one 400 Gb/s NIC per GPU
KERNEL = 5e-6  # seconds per kernel launch
# NCCL 2.30.7 (src/graph/tuning.cc), Simple protocol, microseconds: base + per ring step inside / across nodes
SIMPLE_BASE, SIMPLE_NVLINK, SIMPLE_NET = 8.4e-6, 3.4e-6, 14.0e-6
LL_BASE, LL_NVLINK = 6.6e-6, 0.6e-6  # LL: lower latency, half the bandwidth


def ring_latency(steps_inside: int, steps_across: int = 0) -> float:
    return SIMPLE_BASE + steps_inside * SIMPLE_NVLINK + steps_across * SIMPLE_NET


def in_node_collective(nbytes_sent: float, ranks: int) -> float:
    """One all-gather / reduce-scatter inside a node: NCCL picks LL or Simple, whichever is faster."""
    simple = ring_latency(ranks - 1) + nbytes_sent / NVLINK
    ll = LL_BASE + (ranks - 1) * LL_NVLINK + nbytes_sent / (NVLINK / 2)
    return min(simple, ll)


# ---- the shapes -------------------------------------------------------------------------------------------
H8, I8, L8 = 4096, 14336, 32
H70, I70, L70 = 8192, 28672, 80
A, D, KV = 32, 128, 8  # 8B: heads, head dim, KV heads (70B: 64 heads)
VOCAB = 128256
LAYER8 = H8 * (A + 2 * KV) * D + A * D * H8 + 3 * H8 * I8  # q, k, v, o, gate, up, down
LAYER70 = H70 * (64 + 2 * KV) * D + 64 * D * H70 + 3 * H70 * I70
P8 = L8 * (LAYER8 + 2 * H8) + H8 + 2 * VOCAB * H8  # + norms, final norm, embedding and output layer
P70 = 70_553_706_496


def hand_megatron_70b(row: int) -> float:
    """TP 8 + SP x PP 4 x DP 1, 1 row x 64 micro-batches: (64 + 3) x the last stage's micro-batch."""
    rate = MEASURED[row]
    layer = (6 * row * LAYER70 / 8  # the layer's GEMMs on one GPU of 8: forward + 2 backward, 6 FLOPs per weight
             + 6 * row * row * 64 * D / 8) / rate  # causal attention, its 1/8 of the heads
    layer += 42 * KERNEL  # Transformer Engine's layer: ~14 kernels forward, 28 backward
    u = row * H70 * 2  # [T, h] in bf16
    layer += 10 * in_node_collective(u * 7 / 8, 8)  # SP: 4 all-gathers + 4 reduce-scatters + 2 all-gathers again
    padded_vocab = 129024  # 128256 rounded up to a multiple of 128 x 8
    head = 6 * row * H70 * padded_vocab / 8 / rate + 3 * in_node_collective(u * 7 / 8, 8)
    p2p = SIMPLE_BASE + SIMPLE_NET + u / 8 / NIC  # the last stage sends one gradient back, over the network
    return (64 + 3) * (20 * layer + head + p2p)  # DP 1: no gradient reduction


def hand_megatron_8b(row: int) -> float:
    """TP 1 x PP 1 x DP 8 (one node), 1 row x 8 micro-batches, distributed optimizer."""
    rate = MEASURED[row]
    layer = (6 * row * LAYER8 + 6 * row * row * A * D) / rate + 42 * KERNEL
    micro_batch = L8 * layer + 6 * row * H8 * VOCAB / rate  # + the output layer (128256 is a multiple of 128)
    # once per step over the 8 ranks of the node: fp32 gradients reduce-scattered behind the last backward
    # (2/3 of a micro-batch), bf16 weights all-gathered behind the next first forward (1/3); 40M-parameter
    # buckets, each call at NCCL's latency
    buckets = -(-P8 // 40_000_000)
    reduce = P8 * 4 * 7 / 8 / NVLINK + buckets * ring_latency(7)
    gather = P8 * 2 * 7 / 8 / NVLINK + buckets * ring_latency(7)
    exposed = max(0.0, reduce - 2 / 3 * micro_batch) + max(0.0, gather - 1 / 3 * micro_batch)
    return 8 * micro_batch + exposed


def hand_deepspeed_8b(row: int) -> float:
    """ZeRO-3 on one node of 8, 1 row x 8 micro-batches, gradient checkpointing, chunked head."""
    rate = MEASURED[row]
    layer = (6 * row * LAYER8 + 6 * row * row * A * D) * 4 / 3 / rate  # checkpointing: the forward again
    layer += 120 * KERNEL * 4 / 3  # the HF layer's eager kernels: ~40 forward, 80 backward, the forward again
    head = 8 * row * H8 * VOCAB / rate  # the chunked head: 4 GEMMs (it recomputes the logits)
    compute = 8 * (L8 * layer + head)
    # per micro-batch: the weights gathered for the forward and again for the backward, a layer per call
    # (34 calls with embedding and head), fp32 gradients reduce-scattered in h^2-element buckets
    gathers = 2 * 8 * (P8 * 2 * 7 / 8 / NVLINK + (L8 + 2) * ring_latency(7))
    buckets = -(-P8 // H8 ** 2)
    reduces = 8 * (P8 * 4 * 7 / 8 / NVLINK + buckets * ring_latency(7))
    return max(compute, gathers + reduces)  # ZeRO overlaps its collectives with compute


def hand_deepspeed_70b(row: int) -> float:
    """ZeRO-3 + hpZ 8 on 4 nodes x 8, 1 row x 2 micro-batches, gradient checkpointing, chunked head."""
    rate = MEASURED[row]
    layer = (6 * row * LAYER70 + 6 * row * row * 64 * D) * 4 / 3 / rate + 120 * KERNEL * 4 / 3
    compute = 2 * (L70 * layer + 8 * row * H70 * VOCAB / rate)
    ring32 = 31 / 32
    # the step's first gather over 32 ranks on 4 nodes: 1/8 of a GPU's ring bytes leave the node, and
    # the node's 8 NICs carry its 8 GPUs'; a ring of 32 has 28 steps inside nodes and 3 across
    first = max(P70 * 2 * ring32 / 8 / NIC, P70 * 2 * ring32 * 7 / 8 / NVLINK) + 82 * ring_latency(28, 3)
    hpz = 3 * (P70 * 2 * 7 / 8 / NVLINK + 82 * ring_latency(7))  # the other 3 gathers from the node's copy
    buckets = -(-P70 // H70 ** 2)
    reduces = 2 * (max(P70 * 4 * ring32 / 8 / NIC, P70 * 4 * ring32 * 7 / 8 / NVLINK)
                   + buckets * ring_latency(28, 3))
    return max(compute, first + hpz + reduces)


CASES = {  # (recipe, overrides, hand model)
    "8B DeepSpeed ZeRO-3, 8 GPUs": ("llama3-8b-gsm8k/smmd.yaml", ["train.micro_batch_size=1", "train.grad_accum=8",
                                                                  "model.gradient_checkpointing=true"],
                                    hand_deepspeed_8b),
    "8B Megatron DP 8": ("llama3-8b-gsm8k/megatron.yaml", ["train.micro_batch_size=1", "train.grad_accum=8"],
                         hand_megatron_8b),
    "70B DeepSpeed ZeRO-3 + hpZ, 32 GPUs": ("scale/llama3-70b-4x8.yaml", ["train.micro_batch_size=1",
                                                                          "train.grad_accum=2"], hand_deepspeed_70b),
    "70B Megatron TP 8 x PP 4": ("scale/llama3-70b-megatron-tp8pp4.yaml", ["train.micro_batch_size=1",
                                                                           "train.grad_accum=64"], hand_megatron_70b),
}


def test_step_model_against_the_hand_model():
    table = ["| case | tokens per row | hand model s | step model s | model / hand | model MFU | dominant terms |",
             "|---|---:|---:|---:|---:|---:|---|"]
    worst = 0.0
    for name, (recipe, overrides, hand) in CASES.items():
        for row in (200, 1024, 4096):
            rep = validate.validate_recipe(CONFIGS / recipe, overrides, offline=True, seq_len=row, gpu="H200",
                                    gpu_mem_gb=141, recommend=False)
            model, by_hand = rep.numbers["step_time_s"], hand(row)
            worst = max(worst, abs(model / by_hand - 1))
            terms = step_model.dominant_terms(rep.numbers["step_parts"], model, 3)
            table.append(f"| {name} | {row} | {by_hand:.3f} | {model:.3f} | {model / by_hand:.2f} | "
                         f"{rep.numbers['mfu']:.1%} | {terms} |")
            assert model == pytest.approx(by_hand, rel=0.2), (name, row, model, by_hand)
    print("\n" + "\n".join(table) + f"\nlargest difference {worst:.1%}")


# ---- the parts --------------------------------------------------------------------------------------------


def test_gemm_rates_interpolate_the_measured_table():
    table = gemm_rates.rate_table("H200", 989.0)
    (x0, r0), (x1, r1), (x2, r2) = table.anchors
    assert (r0, r1, r2) == (161.0, 317.0, 367.0)
    # the anchors sit at the TP-8 70B slice's FLOP-weighted mean intensity, e.g. at 200 tokens:
    work = {(8192, 1280): 8192 * 1280, (1024, 8192): 1024 * 8192, (8192, 7168): 8192 * 7168, (3584, 8192): 3584 * 8192}
    ai = sum(w * 200 * n * k / (200 * k + k * n + 200 * n) for (k, n), w in work.items()) / sum(work.values())
    assert x0 == pytest.approx(ai) and 180 < x0 < 190
    assert table.tflops((x0 * x1) ** 0.5) == pytest.approx((r0 + r1) / 2)  # linear in log intensity
    assert table.tflops(x0 / 2) == pytest.approx(r0 / 2)  # below the table: in proportion to the intensity
    assert table.tflops(10 * x2) == r2  # above: the largest measured rate
    # a whole reference slice, each GEMM at its own rate, lands within 3 % of the measured slice rates
    shapes = gemm_rates.gemm_shapes(8192, 28672, 64, 8, 128, 8)
    for tokens, measured in gemm_rates.MEASURED_H200:
        seconds, flops = gemm_rates.layer_gemm_seconds(table, tokens, shapes)
        assert flops / seconds / 1e12 == pytest.approx(measured, rel=0.03)
    a100 = gemm_rates.rate_table("A100", 312.0)
    assert a100.plateau == pytest.approx(367 * 271.2 / 794.5)  # the MAMF ratio
    assert gemm_rates.rate_table("H200", 989.0, "float32").plateau == pytest.approx(367 / 2)  # TF32
    assert gemm_rates.rate_table("H100", 989.0, plateau=600).tflops(10 * x2) == pytest.approx(600)  # --gpu-tflops
    assert gemm_rates.gpu_name("NVIDIA H200") == "H200" and gemm_rates.gpu_name(None, 989.0, 80) == "H100"


def test_collectives_pay_nccls_latency_per_call():
    hw = step_model.Hardware()
    # a 1 MB all-gather over the 8 GPUs of a node: LL wins, 6.6 + 7 x 0.6 us + 7/8 MB at half of 360 GB/s
    small = step_model.Collective("x", 1e6 * 7 / 8, nodes=1, per_node=8, calls=1, kind="all_gather", ranks=8)
    assert small.time(hw) == pytest.approx(10.8e-6 + 0.875e6 / 180e9)
    # 100 of them: 100 latencies; without a group size (ranks 0): bandwidth only
    many = step_model.Collective("x", 100 * 1e6 * 7 / 8, 1, 8, 100, "all_gather", 8)
    assert many.time(hw) == pytest.approx(100 * small.time(hw)) and many.latency_s(hw) == pytest.approx(100 * 10.8e-6)
    assert step_model.Collective("x", 1e6, 1, 8, 1).time(hw) == pytest.approx(1e6 / 360e9)
    # 1 GB over 32 ranks on 4 nodes: Simple, 8.4 + 28 x 3.4 + 3 x 14 us + the longer of network and NVLink
    big = step_model.Collective("y", 1e9, nodes=4, per_node=8, calls=1, kind="reduce_scatter", ranks=32)
    assert big.time(hw) == pytest.approx(145.6e-6 + max(1e9 / 8 / 50e9, 1e9 * 7 / 8 / 360e9))
    assert step_model.latency_s("all_reduce", 8, 1, "Simple") == pytest.approx(8.4e-6 + 14 * 3.4e-6)


def test_expected_padding_by_hand():
    """Rows of 100 or 300 tokens, half each (mean 200)."""
    lengths = np.array([100, 300])
    # micro-batches of 2 random rows pad to the longer: 300 unless both are 100 (1/4): 250 on average
    plain = padding.deal(lengths, micro_batch=2, micro_batches=1, dp=2, bucketing=False)
    assert plain.padded_tokens == pytest.approx(2 * 2 * 250) and plain.padding_ratio == pytest.approx(1.25)
    # sorted, the step's 4 rows give block 0 the longest (300 unless all four are 100: 287.5) and block 1 the
    # 3rd longest (300 when at least three are: 5/16: 162.5)
    bucketed = padding.deal(lengths, micro_batch=2, micro_batches=1, dp=2, bucketing=True)
    assert bucketed.padded_tokens == pytest.approx(2 * (287.5 + 162.5)) and bucketed.padding_ratio == pytest.approx(1.125)
    # ranks meeting at every micro-batch wait for the longest of their 4 rows either way: 2 rows of 287.5
    for bucketing in (False, True):
        step = padding.deal(lengths, micro_batch=2, micro_batches=1, dp=2, bucketing=bucketing, lockstep=True)
        assert sum(s.mean() for s in step.critical) == pytest.approx(2 * 287.5)
    # real tokens back to back (Megatron's THD): no padding; sorted, block 0 holds the longest and the 2nd
    # longest (300 when at least two of four are: 11/16, so 237.5): 525 tokens, block 1 the rest, 275
    thd = padding.deal(lengths, micro_batch=2, micro_batches=1, dp=2, bucketing=True, concat=True)
    assert thd.padding_ratio == pytest.approx(1.0) and thd.critical[0].mean() == pytest.approx(525)
    assert sorted(thd.typical.values.tolist()) == [275, 525]
    assert padding.deal(lengths, micro_batch=2, micro_batches=3, dp=1, bucketing=False, concat=True).typical.mean() == 400
    # rounded up to multiples of 128: 100 -> 128, 300 -> 384; data.seq_len pads every row
    assert padding.deal(lengths, micro_batch=1, micro_batches=1, dp=1, bucketing=False, pad_multiple=128).padded_tokens \
        == pytest.approx(256)
    assert padding.deal(lengths, micro_batch=2, micro_batches=3, dp=1, bucketing=True, fixed=512).padding_ratio \
        == pytest.approx(512 / 200)


def test_mfu_is_derived_from_the_predicted_time():
    """MFU = model FLOPs of the real tokens / (predicted step x GPUs x peak), padding not counted; with a
    faster GEMM table it passes the 40.4 % the old fixed rate capped it at."""
    from recipes.engines.deepspeed.pure import costs
    from recipes.planning.shape import Shape

    s = Shape(layers=80, hidden=8192, intermediate=28672, heads=64, kv_heads=8, head_dim=128, vocab=VOCAB)
    zero = costs.ZeroSettings(zero_stage=3, hpz=8, micro_batch_size=4, grad_accum=1, chunked=True,
                              prefetch_bucket=H70 * I70, reduce_bucket=H70 * H70)
    rows = step_model.Rows(200, 300, "", np.array([100, 300]), bucketing=False, pad_multiple=1)
    pl = costs.estimate(s, P70, H70 * VOCAB, costs.placement(4, 8), zero, rows, step_model.Hardware(gpu="H200"))
    # 128 rows: 6 N per real token, causal attention 6 a d L per token per row length (E[L^2] = 50,000)
    real = 128 * (6 * (L70 * LAYER70 + VOCAB * H70) * 200 + 6 * 64 * D * L70 * (100 ** 2 + 300 ** 2) / 2)
    assert pl.mfu == pytest.approx(real / (pl.step_s * 32 * 989e12))
    assert pl.padding_ratio == pytest.approx(4 * 300 * (15 / 16) / 800 + 4 * 100 / 16 / 800)  # longest of 4 rows
    # one node, 4096-token rows, GEMMs at 900 TFLOP/s at the largest shapes: compute-bound, MFU past 40.4 %
    one = replace(zero, hpz=1, micro_batch_size=2)
    fast = costs.estimate(s, P70, H70 * VOCAB, costs.placement(1, 8), one, step_model.Rows(4096, 4096, "", np.array([4096])),
                          step_model.Hardware(gpu="H200", gpu_tflops=900))
    assert fast.limit == "compute" and 0.6 < fast.mfu < 900 / 989
