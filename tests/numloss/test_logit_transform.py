"""The model's logit scale and soft cap (`numloss.logit_transform`) on the paths that compute logits from
hidden states: read from tiny random Gemma-2, Gemma-3, Granite and Cohere configs, the transform of
`hidden @ Wᵀ` equals the HF model's own logits; the chunked head (eager here, fused under Triton's
interpreter in a process of its own) and `NumericCausalLM(chunked=True)` give the objective and the
gradients of the objective on those logits; without the transform they would not (checked, so the test
can fail)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from numloss import NumericVocab, Objective, fused_pass
from numloss.logit_transform import LogitTransform

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
V, DIGITS = 67, list(range(10, 20))
SPEC = {"terms": {"smmd": {}, "ntl_was": {}, "gce": {"weight": 0.5}}}
SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def _config(family: str):
    """Tiny configs whose transform moves the logits far: a soft cap below the logits' size (raised by a
    large init), a scale far from 1."""
    c = transformers
    if family == "gemma2":
        return c.Gemma2Config(**SMALL, head_dim=8, final_logit_softcapping=0.7, initializer_range=0.3)
    if family == "gemma3":
        return c.Gemma3TextConfig(**SMALL, head_dim=8, final_logit_softcapping=0.7, initializer_range=0.3)
    if family == "granite":
        return c.GraniteConfig(**SMALL, logits_scaling=8.0)
    if family == "cohere":
        return c.CohereConfig(**SMALL, logit_scale=3.0, initializer_range=0.1)
    raise ValueError(family)


FAMILIES = ["gemma2", "gemma3", "granite", "cohere"]
WANT = {"gemma2": LogitTransform(1.0, 0.7), "gemma3": LogitTransform(1.0, 0.7),
        "granite": LogitTransform(1 / 8.0, None), "cohere": LogitTransform(3.0, None)}


def _model(family: str):
    torch.manual_seed(0)
    config = _config(family)
    config._attn_implementation = "eager"
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(V, (2, 12), generator=g)
    ids[:, 4:7] = torch.tensor(DIGITS)[torch.randint(10, (2, 3), generator=g)]
    labels = ids.clone()
    labels[:, :3] = -100
    return ids, labels


def test_from_model_config_reads_each_family_and_leaves_llama_alone():
    for family in FAMILIES:
        assert LogitTransform.from_model_config(_config(family)) == WANT[family]
    assert LogitTransform.from_model_config(transformers.LlamaConfig(**SMALL)).identity
    assert LogitTransform.from_model_config(None).identity
    with pytest.raises(ValueError, match="soft cap"):
        LogitTransform(softcap=0.0)


@pytest.mark.parametrize("family", FAMILIES)
def test_transformed_hidden_times_weight_is_the_models_logits_and_the_chunked_head_matches(family):
    from numloss.adapters.deepspeed_autotp import shift_labels
    from numloss.adapters.hf import NumericCausalLM

    model = _model(family)
    ids, labels = _batch()
    transform = LogitTransform.from_model_config(model.config)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        hidden = getattr(model, model.base_model_prefix)(input_ids=ids).last_hidden_state
        weight = model.get_output_embeddings().weight
        raw = hidden @ weight.t()
    torch.testing.assert_close(transform.apply(raw), logits, rtol=1e-5, atol=1e-5)
    assert (raw - logits).abs().max() > 0.05  # the transform matters at these sizes

    vocab = NumericVocab(DIGITS, list(range(10)), vocab_size=V)
    objective = Objective(vocab, SPEC)
    targets = shift_labels(labels)
    h_ref, w_ref = hidden.clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
    ref = objective(transform.apply(h_ref @ w_ref.t()), targets)
    ref.loss.backward()
    assert torch.allclose(ref.loss, objective(logits, targets).loss)
    for chunk in (1, 7, 1000):
        h, w = hidden.clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
        out = objective.from_hidden(h, w, targets, chunk_size=chunk, logit_transform=transform)
        out.loss.backward()
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
        for name in ref.terms:
            torch.testing.assert_close(out.terms[name], ref.terms[name], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-4, atol=1e-6)
    plain = objective.from_hidden(hidden, weight.detach(), targets)
    assert abs(float(plain.loss.detach()) - float(ref.loss.detach())) > 1e-3  # without the transform: another model's loss

    # the HF adapter's chunked path reads the transform from the model's config
    wrapped = NumericCausalLM(model, objective, chunked=True, chunk_size=5)
    full = NumericCausalLM(model, objective, chunked=False)
    with torch.no_grad():
        torch.testing.assert_close(wrapped(ids, labels).loss, full(ids, labels).loss, rtol=1e-5, atol=1e-6)


def test_bf16_weight_with_a_soft_cap_tracks_fp32():
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(2, 9, 16, generator=g), torch.randn(V, 16, generator=g)
    labels = torch.randint(V, (2, 9), generator=g)
    labels[:, 2:5] = torch.tensor(DIGITS[:3])
    objective = Objective(NumericVocab(DIGITS, list(range(10)), vocab_size=V), SPEC)
    transform = LogitTransform(0.5, 2.0)
    ref = objective(transform.apply(hidden @ weight.t()), labels)
    h, w = hidden.bfloat16().requires_grad_(True), weight.bfloat16().requires_grad_(True)
    out = objective.from_hidden(h, w, labels, chunk_size=4, logit_transform=transform)
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss, rtol=2e-2, atol=2e-2)
    assert h.grad.dtype == torch.bfloat16 and torch.isfinite(h.grad.float()).all()


FUSED_SCRIPT = r"""
import torch
from numloss import NumericVocab, Objective
from numloss.logit_transform import LogitTransform
V, DIGITS = 67, list(range(10, 20))
g = torch.Generator().manual_seed(2)
objective = Objective(NumericVocab(DIGITS, list(range(10)), vocab_size=V),
                      {"terms": {"smmd": {}, "ntl_was": {}, "gce": {"weight": 0.5}}})
hidden, weight = torch.randn(2, 9, 16, generator=g), torch.randn(V, 16, generator=g)
labels = torch.randint(V, (2, 9), generator=g)
labels[:, 2:5] = torch.tensor(DIGITS[:3]); labels[0, :2] = -100
for transform in (LogitTransform(0.5, 2.0), LogitTransform(3.0, None)):
    grads = []
    for fused in (False, True):
        objective.fused = fused
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = objective.from_hidden(h, w, labels, chunk_size=4, logit_transform=transform)
        out.loss.backward()
        grads.append((out.loss, h.grad, w.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
print("fused == eager")
"""


@pytest.mark.timeout(300)
@pytest.mark.skipif(not fused_pass.triton_imports(), reason="triton does not import")
def test_fused_chunked_head_with_the_transform_equals_eager_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    env.pop("NUMLOSS_FUSED", None)
    proc = subprocess.run([sys.executable, "-c", FUSED_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0 and "fused == eager" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
