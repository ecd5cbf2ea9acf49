"""The Objective: defaults, total = CE + Σ w·term, weight 0 == plain CE (value and gradient), GCE
replacing CE, z-loss, config errors, rescale_to_ce, and the all-ignored / no-numeric edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from numloss import DEFAULT_WEIGHTS, NumericVocab, Objective, ObjectiveConfig, TermConfig
from numloss import functional as F
from tests.numloss import numeric_reference as R

pytestmark = pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")

V = 20
DIG = [13, 4, 18, 6, 15, 7, 11, 8, 19, 10]  # DIG[d] is the id of digit d
DOT, NONNUM = 1, 2
VALUES = [float(d) for d in range(10)]

ALL_TERMS = ["ntl_was", "ntl_mse", "gce", "dist2", "ntil", "smmd", "del", "numeric_smoothing"]
NON_GCE = [t for t in ALL_TERMS if t != "gce"]


@pytest.fixture(scope="module")
def dig():
    return NumericVocab(DIG, VALUES, vocab_size=V, decimal_point_id=DOT)


def _batch(seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 8, V, generator=g) * scale
    pool = DIG + [NONNUM, DOT, 0, 3, -100]
    labels = torch.tensor(pool)[torch.randint(len(pool), (3, 8), generator=g)]
    labels[0, 2:6] = torch.tensor([DIG[4], DIG[0], DIG[7], DOT])
    return logits, labels


def _opts(name):
    return {"noise_scale": 0.0} if name == "ntil" else {}


def _functional(name):
    """numloss.functional's form of a term (DEL's is `digit_entropy`: `del` is a Python keyword)."""
    return F.digit_entropy if name == "del" else getattr(F, name)


def _grad(fn, logits):
    x = logits.clone().requires_grad_()
    out = fn(x)
    out.backward()
    return out.detach(), x.grad


# ---- defaults -------------------------------------------------------------------------------------------


def test_default_weights():
    assert DEFAULT_WEIGHTS["smmd"] == 3.0
    assert DEFAULT_WEIGHTS["ntl_was"] == 0.3
    assert DEFAULT_WEIGHTS["ntl_mse"] == 0.3
    assert DEFAULT_WEIGHTS["ntil"] == 0.3
    assert DEFAULT_WEIGHTS["dist2"] == 0.1
    assert DEFAULT_WEIGHTS["gce"] == 1.0
    assert DEFAULT_WEIGHTS["del"] == 0.01
    cfg = ObjectiveConfig.from_dict({"terms": {name: {} for name in ALL_TERMS}})
    assert {k: t.weight for k, t in cfg.terms.items()} == DEFAULT_WEIGHTS
    assert cfg.z_loss == 0.0 and cfg.ignore_index == -100


def test_config_forms():
    cfg = ObjectiveConfig.from_dict(
        {"terms": {"smmd": None, "ntl_was": 0.7, "dist2": {"weight": 2, "tau": 2.0},
                   "ntil": {"options": {"noise_scale": 0.0}, "digit_exp": 1.5, "rescale_to_ce": True},
                   "gce": TermConfig(options={"sigma": 0.5})}}
    )
    assert cfg.terms["smmd"].weight == 3.0 and cfg.terms["smmd"].options == {}
    assert cfg.terms["ntl_was"].weight == 0.7
    assert cfg.terms["dist2"].weight == 2.0 and cfg.terms["dist2"].options == {"tau": 2.0}
    assert cfg.terms["ntil"].options == {"noise_scale": 0.0, "digit_exp": 1.5}
    assert cfg.terms["ntil"].rescale_to_ce is True and cfg.terms["ntil"].weight == 0.3
    assert cfg.terms["gce"].weight == 1.0 and cfg.terms["gce"].options == {"sigma": 0.5}


def test_no_terms_is_plain_ce(dig):
    logits, labels = _batch()
    out = Objective(dig)(logits, labels)
    assert torch.equal(out.loss, F.cross_entropy(logits, labels, dig))
    assert out.terms == {}
    ref = R.ce(logits.double(), labels)
    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-6)


# ---- total = CE + Σ w·term -------------------------------------------------------------------------------


def test_total_is_ce_plus_weighted_terms(dig):
    logits, labels = _batch(1)
    weights = {"ntl_was": 0.3, "ntl_mse": 0.05, "dist2": 0.1, "ntil": 0.3, "smmd": 3.0}
    obj = Objective(dig, {"terms": {n: {"weight": w, **_opts(n)} for n, w in weights.items()}})
    out = obj(logits, labels)
    ce = F.cross_entropy(logits, labels, dig)
    assert torch.equal(out.ce, ce)
    expected = ce.item()
    for name, w in weights.items():
        value = getattr(F, name)(logits, labels, dig, **_opts(name))
        assert out.terms[name].item() == pytest.approx(value.item(), rel=1e-6), name
        expected += w * value.item()
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)
    # against the independent reference too
    x = logits.double()
    ref = R.ce(x, labels) + sum(w * getattr(R, n)(x, labels, DIG, VALUES) for n, w in weights.items())
    assert out.loss.item() == pytest.approx(ref.item(), rel=2e-5)
    # the numeric position count: labels that are digit tokens
    assert out.numeric_positions == int(sum((labels == i).sum() for i in DIG))
    logged = out.log_dict()
    assert logged["loss"] == pytest.approx(out.loss.item()) and logged["ce"] == pytest.approx(ce.item())
    assert set(logged) == {"loss", "ce", "numeric_positions"} | {f"term/{n}" for n in weights}


def test_total_gradient_matches_sum_of_functional_gradients(dig):
    logits, labels = _batch(2)
    weights = {"ntl_was": 0.3, "dist2": 0.1, "ntil": 0.3, "smmd": 3.0}
    obj = Objective(dig, {"terms": {n: {"weight": w, **_opts(n)} for n, w in weights.items()}})
    _, g_obj = _grad(lambda x: obj(x, labels).loss, logits)

    def separate(x):
        total = F.cross_entropy(x, labels, dig)
        for n, w in weights.items():
            total = total + w * getattr(F, n)(x, labels, dig, **_opts(n))
        return total

    _, g_sep = _grad(separate, logits)
    assert torch.allclose(g_obj, g_sep, atol=1e-6, rtol=1e-5)


def test_gce_replaces_ce(dig):
    logits, labels = _batch(3)
    out = Objective(dig, {"terms": {"gce": {}}})(logits, labels)
    gce = F.gce(logits, labels, dig)
    assert torch.equal(out.loss, gce)
    v1, g1 = _grad(lambda x: Objective(dig, {"terms": {"gce": {}}})(x, labels).loss, logits)
    v2, g2 = _grad(lambda x: F.gce(x, labels, dig), logits)
    assert torch.equal(v1, v2) and torch.allclose(g1, g2, atol=1e-7, rtol=1e-6)
    # half weight: the mix (1 - w)·CE + w·GCE
    half = Objective(dig, {"terms": {"gce": 0.5}})(logits, labels)
    ce = F.cross_entropy(logits, labels, dig)
    assert half.loss.item() == pytest.approx(0.5 * ce.item() + 0.5 * gce.item(), rel=1e-6)
    # gce plus another term
    both = Objective(dig, {"terms": {"gce": {"sigma": 2.0}, "smmd": {}}})(logits, labels)
    expected = F.gce(logits, labels, dig, sigma=2.0).item() + 3.0 * F.smmd(logits, labels, dig).item()
    assert both.loss.item() == pytest.approx(expected, rel=1e-6)


# ---- every weight 0 == plain CE, value and gradient ---------------------------------------------------------


@pytest.mark.parametrize("terms", [[t] for t in ALL_TERMS] + [ALL_TERMS], ids=ALL_TERMS + ["all"])
@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
def test_weight_zero_is_exactly_plain_ce(dig, terms, z_loss):
    logits, labels = _batch(4)
    obj = Objective(dig, {"z_loss": z_loss, "terms": {n: {"weight": 0.0, **_opts(n)} for n in terms}})
    v_obj, g_obj = _grad(lambda x: obj(x, labels).loss, logits)
    v_ce, g_ce = _grad(lambda x: F.cross_entropy(x, labels, dig, z_loss=z_loss), logits)
    assert torch.equal(v_obj, v_ce)
    assert torch.equal(g_obj, g_ce)
    # the terms are still computed and reported
    out = obj(logits, labels)
    assert set(out.terms) == set(terms)
    assert all(torch.isfinite(v) for v in out.terms.values())


def test_weight_zero_with_peaked_logits(dig):
    """Extreme logits (exact one-hot p, -inf-free) must not leak NaN/inf through a zero weight."""
    logits = torch.zeros(1, 4, V)
    labels = torch.tensor([[DIG[1], DIG[2], DOT, NONNUM]])
    for s, i in enumerate([DIG[9], DIG[2], DOT, 5]):
        logits[0, s, i] = 1000.0
    obj = Objective(dig, {"terms": {n: {"weight": 0.0, **_opts(n)} for n in ALL_TERMS}})
    v_obj, g_obj = _grad(lambda x: obj(x, labels).loss, logits)
    v_ce, g_ce = _grad(lambda x: F.cross_entropy(x, labels, dig), logits)
    assert torch.equal(v_obj, v_ce) and torch.equal(g_obj, g_ce)


# ---- z-loss ---------------------------------------------------------------------------------------------


def test_z_loss(dig):
    logits, labels = _batch(5)
    plain = Objective(dig, {"z_loss": 0.0})(logits, labels).loss
    assert torch.equal(plain, F.cross_entropy(logits, labels, dig))
    assert torch.equal(Objective(dig, ObjectiveConfig(z_loss=0))(logits, labels).loss, plain)
    z = 1e-2
    out = Objective(dig, {"z_loss": z})(logits, labels)
    x = logits.double().reshape(-1, V)
    valid = labels.reshape(-1) != -100
    lse = torch.logsumexp(x, dim=-1)[valid]
    assert out.loss.item() == pytest.approx(plain.item() + z * (lse**2).mean().item(), rel=1e-6)
    assert out.ce.item() == pytest.approx(out.loss.item(), rel=1e-7)
    # all ignored: z-loss adds nothing, total 0
    empty = Objective(dig, {"z_loss": z})(logits, torch.full_like(labels, -100))
    assert empty.loss.item() == 0.0


def test_z_loss_survives_gce(dig):
    # GCE replaces CE, not the z-loss: total = GCE + z * mean(lse^2)
    logits, labels = _batch(5)
    z = 1e-2
    out = Objective(dig, {"z_loss": z, "terms": {"gce": {}}})(logits, labels)
    lse = torch.logsumexp(logits.double().reshape(-1, V), dim=-1)[labels.reshape(-1) != -100]
    expected = F.gce(logits, labels, dig).item() + z * (lse**2).mean().item()
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)


# ---- config errors ---------------------------------------------------------------------------------------


def test_from_dict_unknown_key():
    with pytest.raises(ValueError) as err:
        ObjectiveConfig.from_dict({"terms": {}, "zloss": 0.1})
    assert "zloss" in str(err.value)


def test_from_dict_unknown_term():
    with pytest.raises(ValueError) as err:
        ObjectiveConfig.from_dict({"terms": {"smmd": {}, "ntl_wass": {}}})
    assert "ntl_wass" in str(err.value)


def test_from_dict_unknown_option():
    with pytest.raises(ValueError) as err:
        ObjectiveConfig.from_dict({"terms": {"smmd": {"sigma": 2.0}}})
    assert "sigma" in str(err.value) and "smmd" in str(err.value)
    with pytest.raises(ValueError) as err:
        ObjectiveConfig.from_dict({"terms": {"ntil": {"options": {"noise": 0.0}}}})
    assert "noise" in str(err.value)
    with pytest.raises(ValueError):
        Objective(NumericVocab([1], [1.0]), {"terms": {"gce": {"tau": 1.0}}})


def test_bad_option_values_raise(dig):
    logits, labels = _batch(6)
    for name, kw in [("dist2", {"normalize": "both"}), ("dist2", {"tau": 0.0}), ("dist2", {"weighting": "x"}),
                     ("smmd", {"mode": "kl"}), ("smmd", {"kernel": "cauchy"}), ("smmd", {"sigmas": ()}),
                     ("gce", {"sigma": -1.0}), ("ntil", {"tau": 0.0}), ("ntl_mse", {"loss": "l3"})]:
        with pytest.raises(ValueError):
            Objective(dig, {"terms": {name: kw}})(logits, labels)


# ---- rescale_to_ce ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NON_GCE)
def test_rescale_to_ce_keeps_value(dig, name):
    logits, labels = _batch(7)
    w = 0.3
    obj = Objective(dig, {"terms": {name: {"weight": w, "rescale_to_ce": True, **_opts(name)}}})
    out = obj(logits, labels)
    assert out.loss.item() == pytest.approx((1 + w) * out.ce.item(), rel=1e-6)
    # the gradient: CE's plus w · stopgrad(CE / term) · the term's
    _, g = _grad(lambda x: obj(x, labels).loss, logits)
    term = _functional(name)
    scale = (F.cross_entropy(logits, labels, dig) / term(logits, labels, dig, **_opts(name))).item()
    _, g_ce = _grad(lambda x: F.cross_entropy(x, labels, dig), logits)
    _, g_t = _grad(lambda x: term(x, labels, dig, **_opts(name)), logits)
    assert torch.allclose(g, g_ce + w * scale * g_t, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("name", NON_GCE)
def test_rescale_to_ce_small_ce_without_numeric_positions(dig, name):
    # CE < ~3.4: stopgrad(CE / clamp(0)) stays finite, so the term adds exactly 0
    logits = torch.zeros(1, 3, V)
    logits[0, :, NONNUM] = 3.0
    labels = torch.tensor([[NONNUM, DOT, NONNUM]])
    out = Objective(dig, {"terms": {name: {"rescale_to_ce": True, **_opts(name)}}})(logits, labels)
    assert out.loss.item() == pytest.approx(out.ce.item(), rel=1e-6)


@pytest.mark.parametrize("name", NON_GCE)
def test_rescale_to_ce_no_numeric_position_is_not_nan(dig, name):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 5, V, generator=g) * 3).requires_grad_()
    labels = torch.full((2, 5), NONNUM)  # valid, but no digit label: CE is about 5-8 here
    out = Objective(dig, {"terms": {name: {"rescale_to_ce": True, **_opts(name)}}})(logits, labels)
    assert out.ce.item() > 4.0
    assert out.terms[name].item() == 0.0
    assert torch.isfinite(out.loss), f"total {out.loss.item()} with CE {out.ce.item()}"
    assert out.loss.item() == pytest.approx(out.ce.item(), rel=1e-6)


# ---- edge cases ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
def test_all_ignored_total_is_zero(dig, z_loss):
    logits = (torch.randn(2, 4, V) * 3).requires_grad_()
    labels = torch.full((2, 4), -100)
    obj = Objective(dig, {"z_loss": z_loss, "terms": {n: _opts(n) for n in ALL_TERMS}})
    out = obj(logits, labels)
    assert out.loss.item() == 0.0 and out.ce.item() == 0.0
    assert all(v.item() == 0.0 for v in out.terms.values())
    out.loss.backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().max() == 0
    assert out.numeric_positions == 0


def test_no_numeric_position_total_is_ce(dig):
    logits = (torch.randn(2, 4, V) * 3).requires_grad_()
    labels = torch.tensor([[NONNUM, DOT, -100, 0], [3, 3, NONNUM, -100]])
    obj = Objective(dig, {"terms": {n: _opts(n) for n in ALL_TERMS}})  # GCE weight 1 replaces CE
    out = obj(logits, labels)
    ce = F.cross_entropy(logits, labels, dig)
    assert out.loss.item() == pytest.approx(ce.item(), rel=1e-6)
    assert all(out.terms[n].item() == 0.0 for n in NON_GCE)
    out.loss.backward()
    assert torch.isfinite(logits.grad).all()


def test_objective_bad_labels_and_shapes(dig):
    obj = Objective(dig, {"terms": {"smmd": {}}})
    with pytest.raises(ValueError, match="-1"):
        obj(torch.zeros(1, 3, V), torch.tensor([[DIG[1], -1, 2]]))
    with pytest.raises(ValueError, match=str(V)):
        obj(torch.zeros(1, 3, V), torch.tensor([[DIG[1], V, 2]]))
    with pytest.raises(ValueError):
        obj(torch.zeros(1, 3, V), torch.tensor([[DIG[1], 2]]))


def test_custom_ignore_index(dig):
    logits, labels = _batch(8)
    relabelled = torch.where(labels == -100, torch.tensor(-1), labels)
    a = Objective(dig, {"terms": {"smmd": {}}})(logits, labels).loss
    b = Objective(dig, {"ignore_index": -1, "terms": {"smmd": {}}})(logits, relabelled).loss
    assert torch.equal(a, b)


def test_bf16_objective(dig):
    logits, labels = _batch(9)
    obj = Objective(dig, {"terms": {n: _opts(n) for n in ALL_TERMS}})
    a = obj(logits.bfloat16(), labels).loss
    b = obj(logits.bfloat16().float(), labels).loss
    assert a.item() == pytest.approx(b.item(), rel=1e-5)
    c = obj(logits, labels).loss
    assert math.isclose(a.item(), c.item(), rel_tol=5e-2)


# ---- checked when the config is made, not at the first forward -------------------------------------------


@pytest.mark.parametrize("terms, words", [
    ({"smmd": -3}, ["smmd", "weight", ">= 0"]),                      # a negative weight trains away from the targets
    ({"smmd": {"weight": float("nan")}}, ["smmd", "weight", "finite"]),
    ({"ntl_was": {"weight": float("inf")}}, ["ntl_was", "weight", "finite"]),
    ({"gce": 1.5}, ["gce", "weight", "<= 1"]),                       # (1 - w) CE would be negative
    ({"smmd": {"sigmas": [0]}}, ["smmd", "sigmas", "> 0"]),
    ({"smmd": {"sigmas": 2.0}}, ["smmd", "sigmas", "list"]),         # a scalar, not a list
    ({"smmd": {"sigmas": [2.0, float("inf")]}}, ["smmd", "sigmas"]),
    ({"dist2": {"tau": 0.0}}, ["dist2", "tau", "> 0"]),
    ({"ntil": {"noise_scale": -0.1}}, ["ntil", "noise_scale"]),
    ({"gce": {"sigma": float("nan")}}, ["gce", "sigma", "finite"]),
    ({"ntl_mse": {"loss": "l3"}}, ["ntl_mse", "loss"]),
])
def test_bad_weights_and_options_are_refused_when_the_config_is_made(terms, words):
    with pytest.raises(ValueError) as err:
        ObjectiveConfig.from_dict({"terms": terms})
    assert all(w in str(err.value) for w in words), str(err.value)


def test_z_loss_must_be_finite_and_not_negative():
    for bad in (-1e-4, float("nan")):
        with pytest.raises(ValueError, match="z_loss"):
            ObjectiveConfig.from_dict({"z_loss": bad})


def test_ntil_with_a_non_digits_vocabulary_is_refused_when_the_objective_is_made():
    integers = NumericVocab(list(range(100, 200)), [float(v) for v in range(100)])
    with pytest.raises(ValueError, match="ntil.*digits"):
        Objective(integers, {"terms": {"ntil": {}}})
    Objective(integers, {"terms": {"smmd": {}}})  # the other terms take any vocabulary
