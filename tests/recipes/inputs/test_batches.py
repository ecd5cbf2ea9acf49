"""recipes.inputs.batches: packed rows train exactly what unpacked rows do.

The same examples, built once unpacked and once packed by data_prep, read whole, go through a tiny
random Llama and the numeric objective: the loss (CE + token-level numeric terms + NTIL, which averages
over examples through the packed rows' sequence ids) and every gradient are the same, for sdpa, eager and the flattened rows flash-attention gets (checked here with sdpa and a
mask from the position restarts, since flash-attn needs a GPU).
"""

from __future__ import annotations

import pytest
import torch

from data_prep.reader import ShardDataset
from recipes.inputs.batches import model_inputs, packed_attention_mask

TERMS = {"smmd": {}, "ntl_was": {}, "dist2": {}, "ntil": {"noise_scale": 0.0}}


@pytest.fixture(scope="module")
def packed_and_unpacked(tmp_path_factory):
    from data_prep import BuildConfig, ShardConfig, SourceConfig, TokenizeConfig, build
    from recipes.experiments.tiny import train_tokenizer

    root = tmp_path_factory.mktemp("pack")
    tok = train_tokenizer(["Calculate 0123456789 + - * / = . ( ) What is"], root / "tok")
    source = SourceConfig("arithmetic", options={"n": 40, "max_digits": 3})
    tokenize = TokenizeConfig(str(root / "tok"), template="plain", max_length=40)
    build(BuildConfig(sources=[source], tokenize=tokenize), str(root / "plain"), workers=0, progress=False)
    build(BuildConfig(sources=[source], tokenize=tokenize, shards=ShardConfig(pack_length=96)), str(root / "packed"),
          workers=0, progress=False)

    def whole(path):
        batches = list(ShardDataset(path, batch_size=1000, shuffle=False, drop_last=False))
        assert len(batches) == 1
        return batches[0]

    return tok, whole(str(root / "plain")), whole(str(root / "packed")), str(root / "packed")


def _loss_and_grads(model, vocab, inputs):
    from numloss import Objective, ObjectiveConfig
    from numloss.adapters.hf import NumericCausalLM

    model.zero_grad()
    out = NumericCausalLM(model, Objective(vocab, ObjectiveConfig.from_dict({"terms": TERMS})), chunked=False)(**inputs)
    out.loss.backward()
    return out, {k: p.grad.clone() for k, p in model.named_parameters()}


def _flash_as_sdpa(inputs):
    """What flash-attention's varlen path computes on the flattened row, expressed for sdpa: one
    segment per run of positions starting at 0."""
    segments = torch.cumsum((inputs["position_ids"] == 0).long(), dim=-1)
    return {**inputs, "attention_mask": packed_attention_mask(segments)}


@pytest.mark.parametrize("impl", ["sdpa", "eager", "flash_attention_2"])
def test_packed_rows_give_the_unpacked_loss_and_gradients(packed_and_unpacked, impl):
    from transformers import AutoConfig, AutoModelForCausalLM

    from numloss import NumericVocab
    from recipes.experiments.tiny import tiny_llama_config

    tok, plain, packed, _ = packed_and_unpacked
    assert packed["input_ids"].shape[0] < plain["input_ids"].shape[0]  # rows really hold several examples
    assert int(packed["segment_ids"].max()) > 1
    cfg = dict(tiny_llama_config(len(tok), hidden=32, layers=2, max_positions=128))
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config._attn_implementation = "sdpa" if impl.startswith("flash") else impl
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    vocab = NumericVocab.from_tokenizer(tok, policy="digits", vocab_size=len(tok))

    plain_inputs, plain_tokens = model_inputs(plain, attn_implementation=impl)
    packed_inputs, packed_tokens = model_inputs(packed, attn_implementation=impl)
    assert plain_tokens == packed_tokens == int((packed["segment_ids"] > 0).sum())
    if impl.startswith("flash"):
        assert packed_inputs["input_ids"].shape[0] == 1 and packed_inputs["attention_mask"] is None
        packed_inputs = _flash_as_sdpa(packed_inputs)
    want, want_grads = _loss_and_grads(model, vocab, plain_inputs)
    got, got_grads = _loss_and_grads(model, vocab, packed_inputs)
    assert got.numeric_positions == want.numeric_positions > 0
    assert got.loss.item() == pytest.approx(want.loss.item(), rel=1e-5)
    for name in TERMS:
        assert got.terms[name].item() == pytest.approx(want.terms[name].item(), rel=1e-5), name
    for k in want_grads:
        torch.testing.assert_close(got_grads[k], want_grads[k], rtol=1e-4, atol=1e-6, msg=k)


def test_the_mask_without_segments_is_what_leaks_across_examples(packed_and_unpacked):
    """The check above can fail: packed rows with only the reader's 2-D mask (the old behaviour) see
    the previous example and give another loss."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from numloss import NumericVocab
    from recipes.experiments.tiny import tiny_llama_config

    tok, plain, packed, _ = packed_and_unpacked
    cfg = dict(tiny_llama_config(len(tok), hidden=32, layers=2, max_positions=128))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    vocab = NumericVocab.from_tokenizer(tok, policy="digits", vocab_size=len(tok))
    leaky = {k: packed[k] for k in ("input_ids", "labels", "attention_mask")}
    want, _ = _loss_and_grads(model, vocab, model_inputs(plain)[0])
    got, _ = _loss_and_grads(model, vocab, leaky)
    assert abs(got.loss.item() - want.loss.item()) > 1e-3


def test_packed_mask_by_hand():
    seg = torch.tensor([[1, 1, 2, 2, 2, 0]])
    allowed = packed_attention_mask(seg)[0, 0].int().tolist()
    assert allowed == [[1, 0, 0, 0, 0, 0],
                       [1, 1, 0, 0, 0, 0],
                       [0, 0, 1, 0, 0, 0],
                       [0, 0, 1, 1, 0, 0],
                       [0, 0, 1, 1, 1, 0],
                       [0, 0, 0, 0, 0, 1]]
    additive = packed_attention_mask(seg, torch.bfloat16)
    assert additive.dtype == torch.bfloat16 and additive[0, 0, 1, 0] == 0
    assert additive[0, 0, 2, 1] == torch.finfo(torch.bfloat16).min


def test_ntil_on_packed_data_is_accepted(packed_and_unpacked):
    """NTIL averages over examples through the packed rows' sequence ids, so packed data is no longer
    refused."""
    from pathlib import Path

    from recipes.validation.validate import validate_recipe

    packed_dir = packed_and_unpacked[3]
    demo = Path(__file__).resolve().parents[3] / "recipes" / "configs" / "demo.yaml"
    rep = validate_recipe(demo, [f"data.train={packed_dir}", "loss.objective={terms: {ntil: 0.3}}"], offline=True,
                          size=False)
    assert not any("is packed" in e for e in rep.errors), rep.errors


def test_flash_rows_carry_the_sequence_boundaries_transformers_would_derive(packed_and_unpacked):
    """Packed rows for flash-attention pass cu_seq_lens / max_length precomputed on the host (transformers
    would otherwise derive them from the positions in every layer, with a device sync each time)."""
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    from recipes.inputs.batches import model_inputs

    _, _, packed, _ = packed_and_unpacked
    inputs, _ = model_inputs(packed, attn_implementation="flash_attention_2")
    (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(inputs["position_ids"])
    assert torch.equal(inputs["cu_seq_lens_q"], cu_q) and torch.equal(inputs["cu_seq_lens_k"], cu_k)
    assert inputs["cu_seq_lens_q"].dtype == torch.int32
    assert inputs["max_length_q"] == int(max_q) == inputs["max_length_k"] and isinstance(inputs["max_length_q"], int)
