"""Long rows on the planner: DeepSpeed-Ulysses (`deepspeed.sp_size`) in recipes.engines.deepspeed.pure.costs, and
`python -m recipes.validate` naming the sp size at which a row that does not fit one GPU fits. Activation
memory at 32k and 128k rows for Llama-3 8B and 70B against hand figures: under Ulysses every layer keeps its
activations for 1/sp of the row's positions (the attention's heads are split, its rows whole), so the
activations and the head divide by sp and the model states stay ZeRO's over every rank; the all-to-all
bytes are worked out by hand (q, k, v in and the output back, (sp - 1) / sp of a slice's each)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from recipes.engines.deepspeed.pure import plan as deepspeed_plan
from recipes.engines.deepspeed.pure import costs
from recipes.planning import step_model
from recipes.planning.memory import layer_activation_bytes
from recipes.planning.shape import Shape
from recipes.validation import validate

CONFIGS = Path(__file__).resolve().parents[3] / "recipes" / "configs"
R8 = CONFIGS / "llama3-8b-gsm8k" / "ce.yaml"
LONG = CONFIGS / "llama3.1-8b-reasoning-32k"
S8 = Shape(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256)
S70 = Shape(layers=80, hidden=8192, intermediate=28672, heads=64, kv_heads=8, head_dim=128, vocab=128256)
P8, P70 = 8_030_261_248, 70_553_706_496
GiB = 2**30


def _plan(shape, params, seq, sp, checkpointing=True, nodes=1):
    rows = step_model.Rows(seq, seq, "")
    where = costs.placement(nodes, 8, 1, sp)
    zero = costs.ZeroSettings(zero_stage=3, micro_batch_size=1, grad_accum=1, e=2, checkpointing=checkpointing,
                              chunked=True, chunk_size=1024, sp=sp, prefetch_bucket=int(0.9 * shape.hidden ** 2),
                              reduce_bucket=shape.hidden ** 2)
    return costs.estimate(shape, params, shape.hidden * shape.vocab, where, zero, rows, step_model.Hardware())


@pytest.mark.parametrize("shape, params", [(S8, P8), (S70, P70)], ids=["8B", "70B"])
@pytest.mark.parametrize("seq", [32768, 131072])
@pytest.mark.parametrize("sp", [2, 4, 8])
def test_activations_and_head_divide_by_sp(shape, params, seq, sp):
    whole, split = _plan(shape, params, seq, 1), _plan(shape, params, seq, sp)
    # checkpointing: every layer's input (e h per token) plus one layer's full activations, at seq / sp tokens
    tokens = seq / sp
    hand = shape.layers * shape.hidden * tokens * 2 + layer_activation_bytes(shape, tokens, 1, 2, fp32_norms=True)
    assert split.memory["activations"] == pytest.approx(hand, rel=1e-12)
    assert split.memory["activations"] == pytest.approx(whole.memory["activations"] / sp, rel=1e-12)
    assert split.memory["model states"] == whole.memory["model states"]  # ZeRO-3 over all 8 GPUs either way
    assert split.memory["head"] < whole.memory["head"]
    assert split.placement.dp == 8 // sp


def test_the_exchange_bytes_by_hand():
    """8B at 32k, sp 4: per layer and pass q (32 heads), k and v (8 KV heads), output (32): 2 bytes x (32 + 32
    + 8 + 8) x 128 per position, of the 8192 positions a GPU holds, 3/4 of it sent; 2 passes (no recompute)."""
    exchange = costs.ulysses_all_to_alls(S8, 32768, 4, 2, False, costs.placement(1, 8, 1, 4))
    assert exchange.ring == pytest.approx(32 * 2 * (2 * 2 * (32 + 8) * 128 * 8192 * 3 / 4))
    assert (exchange.kind, exchange.ranks, exchange.calls, exchange.nodes) == ("all_to_all", 4, 4 * 64, 1)
    pl = _plan(S8, P8, 32768, 4, checkpointing=False)
    assert pl.parts["Ulysses all-to-alls"] > 0


def test_documented_figures():
    """The figures docs/long-rows.md quotes (GiB per GPU, H100, ZeRO-3, checkpointing on)."""
    got = {(name, seq, sp): round(_plan(shape, p, seq, sp).total / GiB, 1)
           for name, shape, p in (("8B", S8, P8), ("70B", S70, P70)) for seq in (32768, 131072) for sp in (1, 8)}
    assert got[("8B", 32768, 1)] < 71.2 < got[("8B", 131072, 1)]  # 8B: 32k fits one GPU, 128k does not
    assert got[("8B", 131072, 8)] < 71.2
    assert got[("70B", 131072, 1)] > got[("70B", 131072, 8)]


def test_validate_names_the_sp_size_at_which_a_128k_row_fits():
    rep = validate.validate_recipe(R8, ["train.micro_batch_size=1", "train.global_batch_size=null"], offline=True,
                                   seq_len=131072)
    [error] = [e for e in rep.errors if e.startswith("memory:")]
    assert "or split each row over 2 GPUs: deepspeed.sp_size=2 fits" in error


def test_ulysses_sizes_follow_the_heads():
    assert deepspeed_plan.ulysses_sizes(S8, 8, 8) == [1, 2, 4, 8]
    assert deepspeed_plan.ulysses_sizes(replace(S8, heads=12, kv_heads=4), 8, 8) == [1, 2, 4]
    assert deepspeed_plan.ulysses_sizes(S8, 8, 4) == [1, 2, 4]


@pytest.mark.parametrize("name", ["deepspeed.yaml", "megatron.yaml"])
def test_the_long_row_recipe_validates_offline(name):
    rep = validate.validate_recipe(LONG / name, offline=True)
    assert rep.ok, rep.render()
    if name == "deepspeed.yaml":
        assert "sequence-parallel 4 (Ulysses), data-parallel 2" in rep.render()
