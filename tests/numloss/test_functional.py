"""A numeric term called on its own (`numloss.functional`), next to a cross-entropy computed elsewhere.

Terms renormalised over the numeric tokens read only the numeric columns and add their gradient into the
one the caller's cross-entropy sends to the same logits; terms that need the full-vocabulary normaliser
make the full pass. Either way the value and gradient must equal the one-pass path (`compute_logit_stats`,
exactly) and the float64 reference (`numeric_reference.py`), alone and added to torch's cross-entropy,
with leaf logits, logits that come out of a matmul and a slice, and bf16 logits.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as TF

from numloss import NumericVocab, functional
from numloss.logit_stats import compute_logit_stats
from numloss.losses import TERMS
from tests.numloss import numeric_reference as R

V = 29
DIGIT_IDS = [13, 4, 18, 6, 15, 7, 11, 8, 19, 10]  # DIGIT_IDS[d] is digit d; not contiguous, not sorted
INT_IDS, INT_VALS = [5, 9, 2, 17, 20, 26], [12.0, 407.0, 0.0, 99.0, 7.0, 3.5]

# (term, options, reads only the numeric columns)
CASES = [
    ("ntl_was", {}, True),
    ("ntl_was", {"squash_factor": 9.0}, True),
    ("ntl_mse", {}, True),
    ("ntl_mse", {"loss": "huber"}, True),
    ("smmd", {}, True),
    ("smmd", {"mode": "mmd", "kernel": "laplace", "sigmas": (1.0, 4.0)}, True),
    ("dist2", {"tau": 2.0, "normalize": "numeric", "weighting": "place_value"}, True),
    ("ntil", {"noise_scale": 0.0}, True),
    ("numeric_smoothing", {"normalize": "numeric", "weighting": "place_value"}, True),
    ("ntl_was", {"reweigh": True}, False),
    ("ntl_mse", {"reweigh": True}, False),
    ("dist2", {}, False),
    ("numeric_smoothing", {}, False),
    ("gce", {"renormalize": True}, False),
]


def _vocab(name):
    if name == "ntil":
        return NumericVocab(DIGIT_IDS, [float(d) for d in range(10)], name="digits")
    return NumericVocab(INT_IDS, INT_VALS, name="ints")


def _batch(vocab, seed=0, shape=(3, 8)):
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(*shape, V, generator=g, dtype=torch.float64)
    ids = vocab.token_ids
    text = [t for t in range(V) if t not in set(ids.tolist())]
    labels = torch.tensor(text)[torch.randint(len(text), shape, generator=g)]
    labels[0, :2] = -100
    labels[0, 2:5] = ids[torch.randint(len(ids), (3,), generator=g)]
    labels[1, 5:8] = ids[torch.randint(len(ids), (3,), generator=g)]
    return logits, labels


def _one_pass(name, options, vocab, logits, labels):
    """The term on the full one-pass stats (what `numloss.Objective` uses)."""
    return TERMS[name](compute_logit_stats(logits, labels, vocab), vocab, **options)


@pytest.mark.parametrize("name,options,numeric_only", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_routing_and_equality_with_the_one_pass_path(name, options, numeric_only):
    vocab = _vocab(name)
    term = getattr(functional, name)
    defaults = {k: p.default for k, p in __import__("inspect").signature(TERMS[name]).parameters.items()
                if p.default is not __import__("inspect").Parameter.empty}
    assert term.needs_full_vocab({**defaults, **options}) is (not numeric_only)
    logits64, labels = _batch(vocab)
    for consumer in ("alone", "with_torch_ce"):
        a = logits64.float().requires_grad_()
        b = logits64.float().requires_grad_()
        extra = (lambda x: TF.cross_entropy(x.reshape(-1, V), labels.reshape(-1))) if consumer != "alone" else (lambda x: 0)
        got = term(a, labels, vocab, **options)
        (extra(a) + got).backward()
        want = _one_pass(name, options, vocab, b, labels)
        (extra(b) + want).backward()
        assert torch.equal(got, want), (consumer, got, want)
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-7, msg=lambda m: f"{consumer}: {m}")
        assert a.grad.layout == torch.strided


@pytest.mark.parametrize("name,options,numeric_only", [c for c in CASES if c[0] != "gce"])
def test_added_to_torch_ce_matches_float64_reference(name, options, numeric_only):
    vocab = _vocab(name)
    ids, values = vocab.token_ids.tolist(), vocab.values.tolist()
    logits64, labels = _batch(vocab, seed=1)
    x = logits64.float().requires_grad_()
    total = TF.cross_entropy(x.reshape(-1, V), labels.reshape(-1)) + getattr(functional, name)(x, labels, vocab, **options)
    total.backward()
    ref_in = logits64.clone().requires_grad_()
    ref_options = {k: v for k, v in options.items() if k != "noise_scale"}  # the reference NTIL is noiseless
    ref = R.ce(ref_in, labels) + getattr(R, name)(ref_in, labels, ids, values, **ref_options)
    ref.backward()
    assert float(total.detach()) == pytest.approx(float(ref.detach()), rel=2e-5)
    scale = float(ref_in.grad.abs().max())
    assert float((x.grad.double() - ref_in.grad).abs().max()) <= 2e-5 * scale + 1e-7


def test_numeric_only_terms_read_no_other_column():
    """NaN in every non-numeric column: a renormalised term alone is unaffected (it never reads them)."""
    vocab = _vocab("smmd")
    logits64, labels = _batch(vocab, seed=2)
    clean = logits64.float()
    poisoned = torch.full_like(clean, float("nan"))
    poisoned[..., vocab.token_ids] = clean[..., vocab.token_ids]
    for name, options, numeric_only in CASES:
        if name == "ntil" or not numeric_only:
            continue
        x = poisoned.clone().requires_grad_()
        got = getattr(functional, name)(x, labels, vocab, **options)
        got.backward()
        assert torch.equal(got, getattr(functional, name)(clean, labels, vocab, **options)), name
        assert torch.isfinite(x.grad).all(), name
    assert torch.isnan(functional.dist2(poisoned, labels, vocab))  # the paper mode needs every column


def test_through_matmul_slice_and_view():
    """Logits from a matmul, sliced per call (the term alone on its slice) or shared with torch's CE."""
    vocab = _vocab("ntl_was")
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 9, 6, generator=g)
    weight = torch.randn(V, 6, generator=g)
    _, labels = _batch(vocab, seed=3, shape=(2, 8))
    results = {}
    for path in ("numeric_only", "one_pass"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logits = h @ w.t()  # [2, 9, V]
        term = (functional.smmd(logits[:, :-1], labels, vocab) if path == "numeric_only"
                else _one_pass("smmd", {}, vocab, logits[:, :-1], labels))
        shifted = logits[:, :-1]
        if path == "numeric_only":
            term = term + functional.ntl_was(shifted, labels, vocab)
        else:
            term = term + _one_pass("ntl_was", {}, vocab, shifted, labels)
        loss = TF.cross_entropy(shifted.reshape(-1, V), labels.reshape(-1)) + term
        loss.backward()
        results[path] = (loss.detach(), h.grad, w.grad)
    for a, b in zip(results["numeric_only"], results["one_pass"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_bf16_logits():
    vocab = _vocab("smmd")
    logits64, labels = _batch(vocab, seed=4)
    a = logits64.bfloat16().requires_grad_()
    b = logits64.bfloat16().requires_grad_()
    (TF.cross_entropy(a.float().reshape(-1, V), labels.reshape(-1)) + functional.smmd(a, labels, vocab)).backward()
    (TF.cross_entropy(b.float().reshape(-1, V), labels.reshape(-1)) + _one_pass("smmd", {}, vocab, b, labels)).backward()
    assert a.grad.dtype == torch.bfloat16
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def test_repeated_calls_on_one_leaf_accumulate():
    vocab = _vocab("ntl_mse")
    logits64, labels = _batch(vocab, seed=5)
    a, b = logits64.float().requires_grad_(), logits64.float().requires_grad_()
    for _ in range(2):  # two backward passes, each with its own term call on the same leaf
        (TF.cross_entropy(a.reshape(-1, V), labels.reshape(-1)) + functional.ntl_mse(a, labels, vocab)).backward()
        (TF.cross_entropy(b.reshape(-1, V), labels.reshape(-1)) + _one_pass("ntl_mse", {}, vocab, b, labels)).backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-7)
    # a term whose result is not backpropagated leaves the next backward alone
    functional.ntl_mse(a, labels, vocab)
    a.grad = b.grad = None
    TF.cross_entropy(a.reshape(-1, V), labels.reshape(-1)).backward()
    TF.cross_entropy(b.reshape(-1, V), labels.reshape(-1)).backward()
    assert torch.equal(a.grad, b.grad)


def test_unknown_option_is_an_error():
    vocab = _vocab("smmd")
    logits64, labels = _batch(vocab)
    with pytest.raises(TypeError, match="sigma"):
        functional.smmd(logits64.float(), labels, vocab, sigma=2.0)
