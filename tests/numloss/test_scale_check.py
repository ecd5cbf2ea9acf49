"""The terms' scale against CE at the start of a run (`numloss.scale_check`): NTL-WAS at its default
weight over a Llama-3-style 'integers' vocabulary (values 0-999) on a random model's first batch is many
times CE and is named with the weight that would match; over single digits it is within the limit and
nothing is said."""

from __future__ import annotations

import math

import pytest
import torch

from numloss import NumericVocab, Objective, ObjectiveConfig
from numloss.scale_check import SCALE_LIMIT, scale_lines, scale_table
from tests.numloss.tokenizers_fixture import as_fast, digit_tokenizer, llama3_tokenizer

transformers = pytest.importorskip("transformers")


def _first_batch_values(tok, policy: str, spec: dict) -> tuple[ObjectiveConfig, float, dict[str, float]]:
    """CE and each term of `spec` on a batch of number answers, from a random Llama at initialisation."""
    fast = as_fast(tok)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2))
    ids = torch.tensor([fast("the sum is 731 and 12 of 998 and 405 .")["input_ids"]])
    objective = Objective(NumericVocab.from_tokenizer(fast, policy=policy), spec)
    with torch.no_grad():
        out = objective(model(input_ids=ids).logits[:, :-1], ids[:, 1:])
    assert out.numeric_positions > 0
    return objective.config, float(out.ce), {k: float(v) for k, v in out.terms.items()}


def test_ntl_was_over_integers_at_initialisation_is_named_with_the_weight_that_matches():
    config, ce, terms = _first_batch_values(llama3_tokenizer(), "integers", {"terms": {"ntl_was": {}}})
    weight = config.terms["ntl_was"].weight
    assert weight * terms["ntl_was"] > SCALE_LIMIT * ce, (ce, terms)  # the setup the check is for
    lines = scale_lines(config, ce, terms)
    assert len(lines) == 1 and lines[0].startswith("term ntl_was = "), lines
    match = ce / terms["ntl_was"]
    assert f"weight {match:.3g} would make it equal CE" in lines[0]
    assert f"is {weight * terms['ntl_was'] / ce:.1f}x CE" in lines[0]
    row = scale_table(config, ce, terms)[0]
    assert math.isclose(row["matching_weight"] * terms["ntl_was"], ce)


def test_terms_within_the_limit_and_rescaled_terms_are_not_named():
    config, ce, terms = _first_batch_values(digit_tokenizer(), "digits", {"terms": {"ntl_was": {}, "smmd": {}}})
    assert all(config.terms[n].weight * v <= SCALE_LIMIT * ce for n, v in terms.items()), (ce, terms)
    assert scale_lines(config, ce, terms) == []
    rescaled = ObjectiveConfig.from_dict({"terms": {"ntl_was": {"rescale_to_ce": True}}})
    assert scale_lines(rescaled, 1.0, {"ntl_was": 1000.0}) == []
    assert scale_lines(ObjectiveConfig.from_dict({"terms": {"ntl_was": {"weight": 0}}}), 1.0, {"ntl_was": 1e6}) == []
