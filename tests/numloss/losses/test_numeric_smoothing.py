"""The soft-target control `numeric_smoothing`: KL(uniform over the numeric tokens || model) at numeric
positions. Against a float64 reference written term by term (value and gradient, both normalisations and
the place-value weighting), a hand case, DIST2 at a very large τ (the same target), weight 0 == plain CE,
its label-smoothing reading, the step-count normalisation, and TP 2 == TP 1 in fp32 and bf16 (gloo)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from numloss import NumericVocab, Objective
from numloss import functional as F
from numloss.logit_stats import compute_logit_stats
from numloss.losses import numeric_smoothing_term
from tests.distributed import run_ranks
from tests.numloss import numeric_reference as R

V = 23
IDS = [3, 7, 8, 12, 15, 16, 20]  # spread over both halves of a TP 2 split
VALUES = [0.0, 1.0, 2.0, 5.0, 40.0, 7.0, 407.0]
OPTIONS = [{}, {"normalize": "numeric"}, {"weighting": "place_value"},
           {"normalize": "numeric", "weighting": "place_value"}]


@pytest.fixture(scope="module")
def vocab():
    return NumericVocab(IDS, VALUES, vocab_size=V)


def _batch(seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(3, 9, V, generator=g, dtype=torch.float64)).to(dtype)
    text = [t for t in range(V) if t not in IDS]
    labels = torch.tensor(text)[torch.randint(len(text), (3, 9), generator=g)]
    labels[0, :2] = -100
    labels[0, 2:5] = torch.tensor(IDS)[torch.randint(len(IDS), (3,), generator=g)]  # a three-token number
    labels[1, 6:9] = torch.tensor(IDS)[torch.randint(len(IDS), (3,), generator=g)]  # one at the row's end
    return logits, labels  # row 2: no numeric label


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_matches_the_float64_reference(vocab, options):
    logits64, labels = _batch(0)
    x = logits64.float().requires_grad_()
    got = F.numeric_smoothing(x, labels, vocab, **options)
    got.backward()
    ref_in = logits64.clone().requires_grad_()
    ref = R.numeric_smoothing(ref_in, labels, IDS, VALUES, **options)
    ref.backward()
    assert float(got) == pytest.approx(float(ref), rel=1e-6)
    torch.testing.assert_close(x.grad.double(), ref_in.grad, rtol=1e-5, atol=1e-7)


def test_hand_case():
    # One position, two numeric tokens with logits 0 and log 3, a text token with logit log 4: the full
    # probabilities are 1/8, 3/8 (and 4/8); KL(u || p) = 1/2 (log(1/2 / (1/8)) + log(1/2 / (3/8))).
    vocab = NumericVocab([0, 1], [0.0, 1.0], vocab_size=3)
    logits = torch.tensor([[[0.0, math.log(3.0), math.log(4.0)]]])
    labels = torch.tensor([[1]])
    full = 0.5 * (math.log(4.0) + math.log(4.0 / 3.0))
    renormalised = 0.5 * (math.log(2.0) + math.log(2.0 / 3.0))  # p = 1/4, 3/4 over the two
    assert float(F.numeric_smoothing(logits, labels, vocab)) == pytest.approx(full, rel=1e-6)
    assert float(F.numeric_smoothing(logits, labels, vocab, normalize="numeric")) == pytest.approx(renormalised, rel=1e-6)


def test_is_dist2_with_the_distance_taken_out(vocab):
    # DIST2's target exp(-(v - y)^2 / tau) is uniform once tau dwarfs the squared distances (407^2 here).
    logits64, labels = _batch(1)
    x = logits64.float()
    for mode in ("full", "numeric"):
        control = F.numeric_smoothing(x, labels, vocab, normalize=mode)
        flat = F.dist2(x, labels, vocab, tau=1e12, normalize=mode)
        sharp = F.dist2(x, labels, vocab, tau=1.0, normalize=mode)
        assert float(control) == pytest.approx(float(flat), rel=1e-5)
        assert abs(float(control) - float(sharp)) > 0.1  # the distances matter at the paper's tau


def test_weight_zero_is_plain_ce_and_the_total_is_label_smoothing(vocab):
    logits64, labels = _batch(2)
    x = logits64.float()

    def value_and_grad(fn):
        leaf = x.clone().requires_grad_()
        out = fn(leaf)
        out.backward()
        return out.detach(), leaf.grad

    v_zero, g_zero = value_and_grad(lambda t: Objective(vocab, {"terms": {"numeric_smoothing": {"weight": 0.0}}})(t, labels).loss)
    v_ce, g_ce = value_and_grad(lambda t: F.cross_entropy(t, labels, vocab))
    assert torch.equal(v_zero, v_ce) and torch.equal(g_zero, g_ce)

    # CE + w KL(u || p) = CE + w (H(u, p) - log N): at the numeric positions, label smoothing of a mass
    # eps = w / (1 + w) over the numeric tokens, at a step 1 + w as long; plain CE elsewhere.
    w = 0.1
    total = Objective(vocab, {"terms": {"numeric_smoothing": {"weight": w}}})(x.double(), labels).loss
    logp = torch.log_softmax(logits64, dim=-1)
    valid = labels >= 0
    numeric = torch.isin(labels, torch.tensor(IDS))
    nll = -logp.gather(-1, labels.clamp_min(0)[..., None]).squeeze(-1)
    smoothed = -logp[..., IDS].mean(-1)
    eps = w / (1 + w)
    per_numeric = (1 + w) * ((1 - eps) * nll + eps * smoothed) - w * math.log(len(IDS))
    # CE is a mean over valid tokens and the term a mean over numeric positions:
    expected = nll[valid].sum() / valid.sum() + w * (smoothed - math.log(len(IDS)))[numeric].mean()
    assert float(total) == pytest.approx(float(expected), rel=1e-6)  # the objective's math is fp32
    kl = smoothed - math.log(len(IDS))  # written as KL(u || p), independently of per_numeric's form
    torch.testing.assert_close(per_numeric[numeric], (nll + w * kl)[numeric], rtol=1e-12, atol=1e-12)


def test_divides_by_the_step_count(vocab):
    logits64, labels = _batch(3)
    stats = compute_logit_stats(logits64.float(), labels, vocab)
    alone = numeric_smoothing_term(stats, vocab)
    m = stats.numeric.count
    assert float(numeric_smoothing_term(stats, vocab, denominator=4 * m)) == pytest.approx(float(alone) / 4, rel=1e-6)
    no_numbers = torch.where(torch.isin(labels, torch.tensor(IDS)), 0, labels)  # 0 is a text token
    leaf = logits64.float().requires_grad_()
    empty = F.numeric_smoothing(leaf, no_numbers, vocab)
    empty.backward()
    assert float(empty) == 0.0 and torch.isfinite(leaf.grad).all()


def _tp2_matches_dense(rank, world):
    start, end = [(0, 12), (12, V)][rank]
    vocab = NumericVocab(IDS, VALUES, vocab_size=V)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2e-2)):
        logits64, labels = _batch(4)
        logits = logits64.to(dtype)
        for options in OPTIONS:
            objective = Objective(vocab, {"terms": {"numeric_smoothing": {"weight": 0.5, **options}}})
            dense_in = logits.clone().requires_grad_()
            dense = objective(dense_in, labels)
            dense.loss.backward()
            local = logits[..., start:end].clone().requires_grad_()
            tp = objective(local, labels, group=dist.group.WORLD, vocab_start=start)
            tp.loss.backward()
            where = f"{dtype} {options} rank {rank}"
            torch.testing.assert_close(tp.loss, dense.loss, rtol=tol, atol=tol, msg=lambda m: f"{where} loss: {m}")
            torch.testing.assert_close(tp.terms["numeric_smoothing"], dense.terms["numeric_smoothing"], rtol=tol,
                                       atol=tol, msg=lambda m: f"{where} term: {m}")
            torch.testing.assert_close(local.grad, dense_in.grad[..., start:end], rtol=tol, atol=tol,
                                       msg=lambda m: f"{where} grad: {m}")
            assert local.grad.dtype == dtype
            if dtype == torch.float32:  # and both equal the float64 reference
                ref = R.ce(logits64, labels) + 0.5 * R.numeric_smoothing(logits64, labels, IDS, VALUES, **options)
                assert float(tp.loss) == pytest.approx(float(ref), rel=1e-5)


def test_tp2_equals_tp1_fp32_and_bf16():
    run_ranks(2, _tp2_matches_dense)
