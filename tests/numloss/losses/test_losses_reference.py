"""Each loss against hand-computed values and against the independent float64 reference
(`numeric_reference.py`, written from docs/losses.md): values, and the library's fp32 autograd gradient
against the reference's float64 autograd gradient."""

from __future__ import annotations

import math

import pytest
import torch

from numloss import NumericVocab
from numloss import functional as F
from tests.numloss import numeric_reference as R

pytestmark = pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")

# Tiny vocabularies. Ids are deliberately not in value order and not contiguous.
V = 16
IDS = [3, 7, 11]
VALS = [2.0, 0.5, 10.0]  # non-unit spacing
NONNUM = 5  # a non-numeric token id

INT_V = 24
INT_IDS = [5, 9, 2, 17, 20]
INT_VALS = [12.0, 407.0, 0.0, 99.0, 7.0]

DIG_V = 20
DIG_IDS = [13, 4, 18, 6, 15, 7, 11, 8, 19, 10]  # DIG_IDS[d] is digit d
DOT, DASH = 1, 2


@pytest.fixture(scope="module")
def vocab():
    return NumericVocab(IDS, VALS, vocab_size=V, name="tiny")


@pytest.fixture(scope="module")
def int_vocab():
    return NumericVocab(INT_IDS, INT_VALS, vocab_size=INT_V, name="ints")


@pytest.fixture(scope="module")
def dig_vocab():
    return NumericVocab(DIG_IDS, [float(d) for d in range(10)], vocab_size=DIG_V, name="digits")


def _logits_with_p(p_by_id: dict[int, float], width: int, other: float = 3.0) -> torch.Tensor:
    """A row of logits whose renormalised numeric distribution is p (non-numeric logits = `other`)."""
    row = torch.full((width,), other, dtype=torch.float64)
    for i, p in p_by_id.items():
        row[i] = math.log(p)
    return row


# ---- hand-computed values -----------------------------------------------------------------------------

# p(0.5) = 0.2, p(2) = 0.3, p(10) = 0.5, at two positions whose targets are 2 and 0.5.
P_HAND = {7: 0.2, 3: 0.3, 11: 0.5}


def _hand_batch():
    row = _logits_with_p(P_HAND, V)
    logits = torch.stack([row, row, torch.zeros(V, dtype=torch.float64)])[None]  # [1, 3, V]
    labels = torch.tensor([[3, 7, NONNUM]])
    return logits.float(), labels


def test_ntl_was_hand(vocab):
    logits, labels = _hand_batch()
    # y=2: 0.2*1.5 + 0.5*8 = 4.3 ; y=0.5: 0.3*1.5 + 0.5*9.5 = 5.2
    assert float(F.ntl_was(logits, labels, vocab)) == pytest.approx((4.3 + 5.2) / 2, rel=1e-6)
    # squash 9: distances 1.5, 8, 9.5 -> 1, 7.5, 9 ; y=2: 0.2*1 + 0.5*7.5 = 3.95 ; y=0.5: 0.3*1 + 0.5*9 = 4.8
    assert float(F.ntl_was(logits, labels, vocab, squash_factor=9.0)) == pytest.approx((3.95 + 4.8) / 2, rel=1e-6)
    # per-position weights (labels-shaped): sum(w * l) / sum(w) over the numeric positions, as the
    # ntloss package reduces (the 7.0 sits on a non-numeric label and counts nowhere)
    w = torch.tensor([[2.0, 0.5, 7.0]])
    assert float(F.ntl_was(logits, labels, vocab, position_weights=w)) == pytest.approx(
        (2 * 4.3 + 0.5 * 5.2) / 2.5, rel=1e-6
    )


def test_ntl_was_reweigh_hand(vocab):
    # numeric mass 0.5: numeric exps 0.1, 0.15, 0.25 and 13 other tokens sharing 0.5
    row = torch.full((V,), math.log(0.5 / 13), dtype=torch.float64)
    for i, p in P_HAND.items():
        row[i] = math.log(0.5 * p)
    logits, labels = row.float()[None], torch.tensor([3])
    # 4.3 * 0.5 + 1.01 * 9.5 * 0.5
    assert float(F.ntl_was(logits, labels, vocab, reweigh=True)) == pytest.approx(4.3 * 0.5 + 1.01 * 9.5 * 0.5, rel=1e-5)
    # mse: E = 5.7, (5.7 - 2)^2 = 13.69 ; max loss = (10 - 0.5)^2
    assert float(F.ntl_mse(logits, labels, vocab, reweigh=True)) == pytest.approx(
        13.69 * 0.5 + 1.01 * 9.5**2 * 0.5, rel=1e-5
    )


def test_ntl_mse_hand(vocab):
    logits, labels = _hand_batch()
    # E[v] = 0.1 + 0.6 + 5 = 5.7
    assert float(F.ntl_mse(logits, labels, vocab)) == pytest.approx((3.7**2 + 5.2**2) / 2, rel=1e-6)
    assert float(F.ntl_mse(logits, labels, vocab, loss="mae")) == pytest.approx((3.7 + 5.2) / 2, rel=1e-6)
    assert float(F.ntl_mse(logits, labels, vocab, loss="huber")) == pytest.approx((3.2 + 4.7) / 2, rel=1e-6)
    # huber's quadratic branch: p(2)=0.9, p(0.5)=0.1, E = 1.85, error -0.15 -> 0.5 * 0.0225
    row = _logits_with_p({3: 0.9, 7: 0.1, 11: 1e-30}, V)
    val = F.ntl_mse(row.float()[None], torch.tensor([3]), vocab, loss="huber")
    assert float(val) == pytest.approx(0.5 * 0.15**2, rel=1e-4)
    with pytest.raises(ValueError, match="bogus"):
        F.ntl_mse(logits, labels, vocab, loss="bogus")


def test_ntl_integers_multi_digit_tokens_hand(int_vocab):
    # p(12) = 0.5, p(407) = 0.25, p(0) = 0.25, target 12
    row = _logits_with_p({5: 0.5, 9: 0.25, 2: 0.25, 17: 1e-30, 20: 1e-30}, INT_V)
    logits, labels = row.float()[None], torch.tensor([5])
    assert float(F.ntl_was(logits, labels, int_vocab)) == pytest.approx(0.25 * 395 + 0.25 * 12, rel=1e-5)
    # E = 6 + 101.75 = 107.75 ; (107.75 - 12)^2 = 9168.0625
    assert float(F.ntl_mse(logits, labels, int_vocab)) == pytest.approx(95.75**2, rel=1e-5)


def test_gce_hand(vocab):
    logits, labels = _hand_batch()
    x = logits[0].double()
    logp = torch.log_softmax(x, dim=-1)
    # position 0, y = 2 (id 3): g over (2, 0.5, 10) ∝ (1, exp(-1.125), exp(-32))
    g0 = [1.0, math.exp(-1.125), math.exp(-32.0)]
    s0 = sum(g0)
    l0 = -(g0[0] * logp[0, 3] + g0[1] * logp[0, 7] + g0[2] * logp[0, 11]) / s0
    # position 1, y = 0.5 (id 7): (2 -> exp(-1.125), 0.5 -> 1, 10 -> exp(-45.125))
    g1 = [math.exp(-1.125), 1.0, math.exp(-45.125)]
    s1 = sum(g1)
    l1 = -(g1[0] * logp[1, 3] + g1[1] * logp[1, 7] + g1[2] * logp[1, 11]) / s1
    l2 = -logp[2, NONNUM]  # non-numeric: plain CE
    expected = float(l0 + l1 + l2) / 3
    assert float(F.gce(logits, labels, vocab)) == pytest.approx(expected, rel=1e-5)
    # sigma 2: (0.5 -> exp(-1.5^2/8))
    g = [1.0, math.exp(-2.25 / 8), math.exp(-64 / 8)]
    l0 = -(g[0] * logp[0, 3] + g[1] * logp[0, 7] + g[2] * logp[0, 11]) / sum(g)
    g = [math.exp(-2.25 / 8), 1.0, math.exp(-90.25 / 8)]
    l1 = -(g[0] * logp[1, 3] + g[1] * logp[1, 7] + g[2] * logp[1, 11]) / sum(g)
    assert float(F.gce(logits, labels, vocab, sigma=2.0)) == pytest.approx(float(l0 + l1 + l2) / 3, rel=1e-5)


def test_gce_renormalized_hand(vocab):
    logits, labels = _hand_batch()
    g0 = [1.0, math.exp(-1.125), math.exp(-32.0)]
    l0 = -(g0[0] * math.log(0.3) + g0[1] * math.log(0.2) + g0[2] * math.log(0.5)) / sum(g0)
    g1 = [math.exp(-1.125), 1.0, math.exp(-45.125)]
    l1 = -(g1[0] * math.log(0.3) + g1[1] * math.log(0.2) + g1[2] * math.log(0.5)) / sum(g1)
    l2 = float(-torch.log_softmax(logits[0, 2].double(), 0)[NONNUM])
    assert float(F.gce(logits, labels, vocab, renormalize=True)) == pytest.approx((l0 + l1 + l2) / 3, rel=1e-5)


def test_dist2_hand(vocab):
    logits, labels = _hand_batch()
    logits, labels = logits[:, :1], labels[:, :1]  # one position, y = 2
    # paper: tau 1, full-vocab p_model. p_d over (2, 0.5, 10) ∝ (1, exp(-2.25), exp(-64))
    e = [1.0, math.exp(-2.25), math.exp(-64.0)]
    pd = [t / sum(e) for t in e]
    logq_full = torch.log_softmax(logits[0, 0].double(), 0)[[3, 7, 11]].tolist()
    kl = sum(pd[j] * (math.log(pd[j]) - logq_full[j]) for j in range(3))
    assert float(F.dist2(logits, labels, vocab)) == pytest.approx(kl, rel=1e-5)
    # code: tau 2, renormalised: p_model = (0.3, 0.2, 0.5) in column order (2, 0.5, 10)
    e = [1.0, math.exp(-2.25 / 2), math.exp(-32.0)]
    pd = [t / sum(e) for t in e]
    q = [0.3, 0.2, 0.5]
    kl = sum(pd[j] * (math.log(pd[j]) - math.log(q[j])) for j in range(3))
    assert float(F.dist2(logits, labels, vocab, tau=2.0, normalize="numeric")) == pytest.approx(kl, rel=1e-5)


def test_dist2_place_value_hand(vocab):
    # three numeric labels in a row then a non-numeric: weights 3, 2, 1; then a lone one: weight 1
    row = _logits_with_p(P_HAND, V)
    logits = row.float().expand(1, 6, V).clone()
    labels = torch.tensor([[3, 3, 3, NONNUM, 3, -100]])
    single = float(F.dist2(logits[:, :1], labels[:, :1], vocab, tau=2.0, normalize="numeric"))
    out = F.dist2(logits, labels, vocab, tau=2.0, normalize="numeric", weighting="place_value")
    # the released code divides by the sum of the weights: every position has the same KL here, so
    # the weighted mean is that KL (dividing by the 4 positions would give 7/4 of it)
    assert float(out) == pytest.approx(single * (3 + 2 + 1 + 1) / (3 + 2 + 1 + 1), rel=1e-5)
    plain = F.dist2(logits, labels, vocab, tau=2.0, normalize="numeric")
    assert float(plain) == pytest.approx(single, rel=1e-5)


def test_smmd_hand(vocab):
    # one position, y = 2 (column 0), p = (0.3, 0.2, 0.5) over columns (2, 0.5, 10), no squash, sigma 2
    row = _logits_with_p(P_HAND, V)
    logits, labels = row.float()[None], torch.tensor([3])
    k = lambda d: math.exp(-d * d / 8)  # noqa: E731
    K = [[1, k(1.5), k(8)], [k(1.5), 1, k(9.5)], [k(8), k(9.5), 1]]
    r = [0.3 - 1, 0.2, 0.5]
    mmd = sum(r[i] * K[i][j] * r[j] for i in range(3) for j in range(3))
    deg = [sum(K[i]) for i in range(3)]
    smooth = sum(deg[i] * r[i] ** 2 for i in range(3)) - mmd
    alpha = 1 / (2 * sum(deg) / 3)
    got = lambda **kw: float(F.smmd(logits, labels, vocab, squash_factor=None, **kw))  # noqa: E731
    assert got() == pytest.approx(mmd + alpha * smooth, rel=1e-5)
    assert got(mode="mmd") == pytest.approx(mmd, rel=1e-5)
    assert got(mode="smooth") == pytest.approx(alpha * smooth, rel=1e-5)
    assert got(alpha=0.7) == pytest.approx(mmd + 0.7 * smooth, rel=1e-5)
    # laplace kernel exp(-D / sigma)
    kl = lambda d: math.exp(-d / 2)  # noqa: E731
    K = [[1, kl(1.5), kl(8)], [kl(1.5), 1, kl(9.5)], [kl(8), kl(9.5), 1]]
    mmd = sum(r[i] * K[i][j] * r[j] for i in range(3) for j in range(3))
    deg = [sum(K[i]) for i in range(3)]
    smooth = sum(deg[i] * r[i] ** 2 for i in range(3)) - mmd
    alpha = 1 / (2 * sum(deg) / 3)
    assert got(kernel="laplace") == pytest.approx(mmd + alpha * smooth, rel=1e-5)


def test_ntil_hand(dig_vocab):
    # target 407 predicted (one-hot) as 417: token EMD: place-weighted |1 - 0| * 1.2^1 at the tens
    d = DIG_IDS
    logits = torch.zeros(1, 3, DIG_V)
    for s, digit in enumerate([4, 1, 7]):
        logits[0, s, d[digit]] = 1000.0
    labels = torch.tensor([[d[4], d[0], d[7]]])
    token = (0 + 1.2 + 0) / 3
    rel = 10 / 418
    mag = math.log(418 / 408)
    expected = token + 0.2 * rel + 0.2 * mag
    assert float(F.ntil(logits, labels, dig_vocab, noise_scale=0.0)) == pytest.approx(expected, rel=1e-6)
    # other mixing weights and digit_exp
    got = F.ntil(logits, labels, dig_vocab, noise_scale=0.0, digit_exp=2.0, digit_alpha=0.5, abs_alpha=1.0, mag_alpha=0.0)
    assert float(got) == pytest.approx(0.5 * 2.0 / 3 + rel, rel=1e-6)


# ---- random batches against the reference ----------------------------------------------------------------


def _random_batch(ids, width, shape=(3, 7), seed=0, scale=3.0, extra_labels=()):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, width, generator=g, dtype=torch.float64) * scale
    pool = list(ids) + [i for i in range(width) if i not in ids][:4] + [-100] + list(extra_labels)
    labels = torch.tensor(pool)[torch.randint(len(pool), shape, generator=g)]
    labels.view(-1)[0] = ids[0]  # at least one numeric position
    return logits, labels


# per-position weights for the (3, 7) random batches: uneven, so sum(w * l) / sum(w) differs from / M
W37 = torch.linspace(0.25, 3.0, 21).reshape(3, 7)

CASES = [
    ("ntl_was", {}, {}),
    ("ntl_was", {"position_weights": W37}, {"position_weights": W37}),
    ("ntl_mse", {"position_weights": W37, "loss": "huber"}, {"position_weights": W37, "loss": "huber"}),
    ("ntl_was", {"squash_factor": 9.0}, {"squash_factor": 9.0}),
    ("ntl_was", {"reweigh": True}, {"reweigh": True}),
    ("ntl_mse", {}, {}),
    ("ntl_mse", {"loss": "mae"}, {"loss": "mae"}),
    ("ntl_mse", {"loss": "huber"}, {"loss": "huber"}),
    ("ntl_mse", {"reweigh": True}, {"reweigh": True}),
    ("gce", {}, {}),
    ("gce", {"sigma": 0.0}, {"sigma": 0.0}),
    ("gce", {"sigma": 2.5, "renormalize": True}, {"sigma": 2.5, "renormalize": True}),
    ("dist2", {}, {}),
    ("dist2", {"tau": 2.0, "normalize": "numeric", "weighting": "place_value"},
     {"tau": 2.0, "normalize": "numeric", "weighting": "place_value"}),
    ("smmd", {}, {}),
    ("smmd", {"squash_factor": None}, {"squash_factor": None}),
    ("smmd", {"mode": "mmd"}, {"mode": "mmd"}),
    ("smmd", {"mode": "smooth"}, {"mode": "smooth"}),
    ("smmd", {"kernel": "laplace", "sigmas": (1.0, 4.0)}, {"kernel": "laplace", "sigmas": (1.0, 4.0)}),
    ("smmd", {"sigmas": (0.5, 2.0, 8.0), "alpha": 0.25}, {"sigmas": (0.5, 2.0, 8.0), "alpha": 0.25}),
]


def _compare(name, lib_kw, ref_kw, vocab, ids, vals, logits64, labels, rtol=2e-5, gtol=2e-5):
    lib_in = logits64.float().requires_grad_()
    lib = getattr(F, name)(lib_in, labels, vocab, **lib_kw)
    lib.backward()
    ref_in = logits64.clone().requires_grad_()
    ref = getattr(R, name)(ref_in, labels, ids, vals, **ref_kw)
    ref.backward()
    assert lib.dtype == torch.float32 and lib.dim() == 0
    assert float(lib) == pytest.approx(float(ref), rel=rtol, abs=1e-6), (name, lib_kw)
    scale = max(float(ref_in.grad.abs().max()), 1e-3)
    err = float((lib_in.grad.double() - ref_in.grad).abs().max())
    assert err <= gtol * scale + 1e-7, (name, lib_kw, err, scale)


@pytest.mark.parametrize("name,lib_kw,ref_kw", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
@pytest.mark.parametrize("which", ["tiny", "ints"])
def test_against_reference(name, lib_kw, ref_kw, which, vocab, int_vocab):
    if which == "tiny":
        voc, ids, vals, width = vocab, IDS, VALS, V
    else:
        voc, ids, vals, width = int_vocab, INT_IDS, INT_VALS, INT_V
    for seed in (0, 1):
        logits, labels = _random_batch(ids, width, seed=seed)
        _compare(name, lib_kw, ref_kw, voc, ids, vals, logits, labels)


@pytest.mark.parametrize("name", ["ntl_was", "ntl_mse", "gce", "dist2", "smmd", "ntil"])
def test_against_reference_on_digits(name, dig_vocab):
    kw = {"noise_scale": 0.0} if name == "ntil" else {}
    for seed in (0, 1, 2):
        logits, labels = _random_batch(DIG_IDS, DIG_V, shape=(4, 9), seed=seed, extra_labels=(DOT, DASH, -100) * 2)
        # long digit runs too
        labels[3, 1:7] = torch.tensor([DIG_IDS[k] for k in (1, 0, 2, 4, 0, 9)])
        _compare(name, kw, {}, dig_vocab, DIG_IDS, [float(d) for d in range(10)], logits, labels)


def test_ce_against_reference_and_torch(vocab):
    logits, labels = _random_batch(IDS, V, seed=3)
    lib_in = logits.float().requires_grad_()
    lib = F.cross_entropy(lib_in, labels, vocab)
    ref = R.ce(logits, labels)
    assert float(lib) == pytest.approx(float(ref), rel=1e-6)
    torch_ce = torch.nn.functional.cross_entropy(logits.float().reshape(-1, V), labels.reshape(-1), ignore_index=-100)
    assert float(lib) == pytest.approx(float(torch_ce), rel=1e-6)
    # z-loss
    z = F.cross_entropy(lib_in, labels, vocab, z_loss=1e-2)
    assert float(z) == pytest.approx(float(R.ce(logits, labels, z_loss=1e-2)), rel=1e-6)


# ---- gradcheck of the reference itself (it is the yardstick for the library's gradients) ------------------


@pytest.mark.parametrize(
    "name,kw",
    [("ntl_was", {"reweigh": True}), ("ntl_mse", {"loss": "huber"}), ("gce", {}), ("dist2", {}),
     ("smmd", {}), ("ntil", {"abs_alpha": 0.0, "mag_alpha": 0.0}), ("ce", {})],
)
def test_reference_gradcheck(name, kw):
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(2, 3, V, generator=g, dtype=torch.float64) * 2).requires_grad_()
    if name == "ntil":
        ids, vals = list(range(10)), [float(d) for d in range(10)]
        labels = torch.tensor([[1, 2, 12], [3, -100, 4]])
    else:
        ids, vals = IDS, VALS
        labels = torch.tensor([[3, 7, NONNUM], [11, -100, 3]])
    if name == "ce":
        fn = lambda x: R.ce(x, labels)  # noqa: E731
    else:
        fn = lambda x: getattr(R, name)(x, labels, ids, vals, **kw)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (logits,), eps=1e-6, atol=1e-6)


def test_library_gradient_finite_differences(vocab):
    """The fp32 library gradient against central differences of the library itself (coarse, fp32)."""
    logits, labels = _random_batch(IDS, V, shape=(2, 3), seed=11, scale=1.0)
    for name in ("ntl_was", "ntl_mse", "gce", "dist2", "smmd"):
        x = logits.float().requires_grad_()
        getattr(F, name)(x, labels, vocab).backward()
        eps = 1e-2
        for flat in (0, 3, 7, 11, 20, 35, 40):
            idx = torch.unravel_index(torch.tensor(flat), x.shape)
            plus, minus = logits.clone(), logits.clone()
            plus[idx] += eps
            minus[idx] -= eps
            fd = (float(getattr(F, name)(plus.float(), labels, vocab)) - float(getattr(F, name)(minus.float(), labels, vocab))) / (2 * eps)
            assert float(x.grad[idx]) == pytest.approx(fd, abs=2e-3, rel=2e-2), (name, flat)
