"""The public term API (`numloss.register_term`): a term registered from a user's module is used by
`Objective` on every path and checked by `ObjectiveConfig.from_dict` as a built-in is; the built-in terms
come through the same door; a bad registration is a clear error that registers nothing."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

import numloss
from numloss import DEFAULT_WEIGHTS, NumericVocab, Objective, ObjectiveConfig
from numloss import functional as F
from numloss.losses import TERMS, registered_terms, term_spec
from numloss.losses.options import finite

V = 20
DIG = [13, 4, 18, 6, 15, 7, 11, 8, 19, 10]  # DIG[d] is the id of digit d
DOT, NONNUM = 1, 2
BUILT_IN = ["ntl_was", "ntl_mse", "gce", "dist2", "ntil", "smmd", "del", "numeric_smoothing"]


@pytest.fixture
def user_terms():
    """Import the user's module (it registers its terms), and take them out again afterwards."""
    module = importlib.import_module("tests.numloss.user_terms")
    yield module
    for name in module.NAMES:
        numloss.unregister_term(name)
    sys.modules.pop("tests.numloss.user_terms", None)


@pytest.fixture
def dig():
    return NumericVocab(DIG, [float(d) for d in range(10)], vocab_size=V, decimal_point_id=DOT)


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 8, V, generator=g) * 3
    pool = DIG + [NONNUM, DOT, 0, 3, -100]
    labels = torch.tensor(pool)[torch.randint(len(pool), (3, 8), generator=g)]
    labels[0, 2:6] = torch.tensor([DIG[4], DIG[0], DIG[7], DOT])
    return logits, labels


def _expected_error_reference(logits: torch.Tensor, labels: torch.Tensor, power: float) -> torch.Tensor:
    """float64, a loop over positions: |Σ_j softmax(l[digits])_j · j - y|^power, mean over digit labels."""
    x = logits.double().reshape(-1, V)
    total, count = torch.zeros((), dtype=torch.float64), 0
    for row, label in zip(x, labels.reshape(-1).tolist()):
        if label in DIG:
            p = torch.softmax(row[DIG], dim=0)
            expected = sum(p[d] * d for d in range(10))
            total = total + abs(expected - DIG.index(label)) ** power
            count += 1
    return total / max(count, 1)


def _ce_reference(logits, labels):
    valid = labels.reshape(-1) != -100
    return torch.nn.functional.cross_entropy(logits.double().reshape(-1, V)[valid], labels.reshape(-1)[valid])


# ---- the built-in terms come through the same door ------------------------------------------------------


def test_built_in_terms_are_registered_with_their_documented_defaults():
    assert registered_terms()[:len(BUILT_IN)] == BUILT_IN
    assert dict(DEFAULT_WEIGHTS) == {"ntl_was": 0.3, "ntl_mse": 0.3, "gce": 1.0, "dist2": 0.1, "ntil": 0.3,
                                     "smmd": 3.0, "del": 0.01, "numeric_smoothing": 0.1}
    assert all(term_spec(name).builtin and TERMS[name] is term_spec(name).fn for name in BUILT_IN)
    assert [name for name in BUILT_IN if term_spec(name).replaces_ce] == ["gce"]
    # what each declares: the full pass, the vocabulary, the count, with their options
    assert term_spec("gce").needs() == {"full_vocab"}
    assert term_spec("dist2").needs() == {"full_vocab"} and term_spec("dist2").needs({"normalize": "numeric"}) == set()
    assert term_spec("numeric_smoothing").needs() == {"full_vocab"}
    assert term_spec("numeric_smoothing").needs({"normalize": "numeric"}) == set()
    assert term_spec("ntl_was").needs({"reweigh": True}) == {"full_vocab"} and term_spec("ntl_was").needs() == set()
    assert term_spec("ntil").needs() == {"digits"}
    assert term_spec("del").needs() == {"ten_digits", "decimal_point"}
    assert term_spec("del").needs({"decimal_point_id": 5}) == {"ten_digits"}
    assert term_spec("dist2").denominator({"weighting": "place_value"}) == "place_value"
    assert term_spec("ntl_mse").denominator({"position_weights": torch.ones(1)}) == "ntl_mse.position_weights"
    assert term_spec("ntil").denominator() == "sequences" and term_spec("del").denominator() == "numeric"


def test_the_registry_views_are_read_only():
    with pytest.raises(TypeError):
        TERMS["mine"] = lambda stats, vocab, denominator=None: stats.numeric.logits.sum()
    with pytest.raises(TypeError):
        DEFAULT_WEIGHTS["mine"] = 1.0
    with pytest.raises(ValueError, match="built-in"):
        numloss.unregister_term("smmd")


# ---- a user's term, used like a built-in --------------------------------------------------------------------


def test_a_users_term_is_used_by_the_objective(user_terms, dig):
    logits, labels = _batch(1)
    obj = Objective(dig, {"terms": {"expected_error": {"power": 2.0}, "smmd": {}}})
    x = logits.clone().requires_grad_(True)
    out = obj(x, labels)
    out.loss.backward()
    reference = _expected_error_reference(logits, labels, 2.0)
    assert out.terms["expected_error"].item() == pytest.approx(reference.item(), rel=1e-5)
    assert out.loss.item() == pytest.approx(out.ce.item() + 0.5 * reference.item() + 3.0 * out.terms["smmd"].item(),
                                            rel=1e-6)
    assert out.log_dict()["term/expected_error"] == pytest.approx(reference.item(), rel=1e-5)
    # the gradient of CE + 0.5 x the term: the float64 reference's, by autograd through the loops
    xd = logits.double().requires_grad_(True)
    (_ce_reference(xd, labels) + 0.5 * _expected_error_reference(xd, labels, 2.0)).backward()
    z = logits.clone().requires_grad_(True)
    Objective(dig, {"terms": {"expected_error": {"power": 2.0}}})(z, labels).loss.backward()
    torch.testing.assert_close(z.grad, xd.grad.float(), rtol=1e-4, atol=1e-6)


def test_a_users_term_follows_the_step_counts_and_the_chunked_head(user_terms, dig):
    logits, labels = _batch(2)
    obj = Objective(dig, {"terms": {"expected_error": {}}})
    assert obj.denominator_keys() == {"ce": "tokens", "expected_error": "numeric"}
    # two micro-batches with the step's counts add up to the whole batch
    step = numloss.reduce_counts([obj.counts(labels[:1]), obj.counts(labels[1:])])
    halves = obj(logits[:1], labels[:1], counts=step).loss + obj(logits[1:], labels[1:], counts=step).loss
    torch.testing.assert_close(halves, obj(logits, labels).loss, rtol=1e-6, atol=1e-7)
    # the chunked head drives the same term
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(3, 8, 16, generator=g), torch.randn(V, 16, generator=g) / 2
    chunked = obj.from_hidden(hidden, weight, labels, chunk_size=4)
    dense = obj(hidden @ weight.t(), labels)
    torch.testing.assert_close(chunked.terms["expected_error"], dense.terms["expected_error"], rtol=1e-5, atol=1e-6)
    # the per-term gradient diagnostics see it as a part
    sums = obj(logits, labels, diagnostics=True).grad_sums
    assert sums["grad_sums/expected_error/sq"] > 0


def test_needs_full_vocab_and_sequence_ids_reach_the_term(user_terms, dig):
    logits, labels = _batch(4)
    out = Objective(dig, {"terms": {"mass_gap": {}}})(logits, labels)
    x = logits.double().reshape(-1, V)
    rows = [i for i, label in enumerate(labels.reshape(-1).tolist()) if label in DIG]
    gap = sum(1 - torch.softmax(x[i], 0)[DIG].sum() for i in rows) / len(rows)
    assert out.terms["mass_gap"].item() == pytest.approx(gap.item(), rel=1e-5)
    # the functional form makes the full pass for a term that needs it, and only for it
    assert F.term_function("mass_gap")(logits, labels, dig).item() == pytest.approx(gap.item(), rel=1e-5)
    assert F.term_function("expected_error").needs_full_vocab({"power": 1.0}) is False
    # a term that takes sequence_ids gets them; the others are not given them
    ids = torch.ones_like(labels)
    user_terms.SEEN_SEQUENCE_IDS.clear()
    Objective(dig, {"terms": {"sequences_seen": {}, "expected_error": {}}})(logits, labels, sequence_ids=ids)
    assert len(user_terms.SEEN_SEQUENCE_IDS) == 1 and user_terms.SEEN_SEQUENCE_IDS[0] is ids


def test_from_dict_checks_a_users_term_as_a_built_in(user_terms):
    cfg = ObjectiveConfig.from_dict({"terms": {"expected_error": {}, "mass_gap": 0.7}})
    assert cfg.terms["expected_error"].weight == 0.5 and cfg.terms["mass_gap"].weight == 0.7
    cases = [
        ({"expected_error": {"power": 0}}, "loss.objective.terms.expected_error.power: must be > 0"),
        ({"expected_error": {"power": "2"}}, "loss.objective.terms.expected_error.power: expected a number"),
        ({"expected_error": {"pow": 2}}, "loss.objective.terms.expected_error.pow: no such option of expected_error;"
                                         " options: ['power']"),
        ({"expected_error": -1}, "loss.objective.terms.expected_error.weight: must be >= 0"),
        ({"expected_error": {"weight": "0.5"}}, "loss.objective.terms.expected_error.weight: expected a number"),
        ({"mass_gap": {"weight": float("nan")}}, "loss.objective.terms.mass_gap.weight: must be a finite number"),
    ]
    for terms, message in cases:
        with pytest.raises(ValueError) as err:
            ObjectiveConfig.from_dict({"terms": terms}, root="loss.objective")
        assert message in str(err.value), str(err.value)
    with pytest.raises(ValueError) as err:
        ObjectiveConfig.from_dict({"terms": {"expected_errors": {}}})
    assert "unknown term" in str(err.value) and "'expected_error'" in str(err.value)


def test_an_unregistered_term_is_unknown_again(dig):
    importlib.import_module("tests.numloss.user_terms")
    try:
        ObjectiveConfig.from_dict({"terms": {"expected_error": {}}})
    finally:
        for name in sys.modules["tests.numloss.user_terms"].NAMES:
            numloss.unregister_term(name)
        sys.modules.pop("tests.numloss.user_terms", None)
    with pytest.raises(ValueError, match="terms.expected_error: unknown term"):
        ObjectiveConfig.from_dict({"terms": {"expected_error": {}}})


def test_a_users_vocabulary_needs_are_checked_when_the_objective_is_made():
    def digits_only(stats, vocab, denominator=None):
        return stats.numeric.logits.sum() * 0

    numloss.register_term("digits_only", digits_only, default_weight=1.0, needs=("digits",))
    try:
        integers = NumericVocab(list(range(100, 200)), [float(v) for v in range(100)])
        with pytest.raises(ValueError, match="term 'digits_only' needs a digits vocabulary"):
            Objective(integers, {"terms": {"digits_only": {}}})
    finally:
        numloss.unregister_term("digits_only")


def test_a_users_term_may_replace_ce(dig):
    def smoothed(stats, vocab, denominator=None):
        return stats.ce_per_token.sum() / (float(stats.valid_count) if denominator is None else denominator)

    numloss.register_term("plain_again", smoothed, default_weight=1.0, needs=("full_vocab",), denominator="tokens",
                          replaces_ce=True)
    try:
        logits, labels = _batch(5)
        out = Objective(dig, {"terms": {"plain_again": 0.25}})(logits, labels)
        assert out.loss.item() == pytest.approx(out.ce.item(), rel=1e-6)  # 0.75 CE + 0.25 CE
        with pytest.raises(ValueError, match="weight: must be <= 1"):
            ObjectiveConfig.from_dict({"terms": {"plain_again": 1.5}})
        with pytest.raises(ValueError, match="gce and plain_again each replace CE"):
            ObjectiveConfig.from_dict({"terms": {"gce": {}, "plain_again": {}}})
    finally:
        numloss.unregister_term("plain_again")


# ---- a bad registration: a clear error, nothing registered -----------------------------------------------------


def _ok(stats, vocab, scale: float = 1.0, denominator=None):
    return stats.numeric.logits.sum() * 0


def _no_denominator(stats, vocab, scale: float = 1.0):
    return stats.numeric.logits.sum() * 0


def _required_option(stats, vocab, scale, denominator=None):
    return stats.numeric.logits.sum() * 0


def _kwargs(stats, vocab, denominator=None, **options):
    return stats.numeric.logits.sum() * 0


def _one_argument(stats, denominator=None):
    return stats.numeric.logits.sum() * 0


@pytest.mark.parametrize("name, fn, kwargs, message", [
    ("smmd", _ok, {"default_weight": 1.0}, "a term 'smmd' is already registered (numloss.losses.smmd.smmd_term)"),
    ("mine", _ok, {}, "default_weight is required"),
    ("mine", _ok, {"default_weight": -1.0}, "default_weight must be >= 0"),
    ("mine", _ok, {"default_weight": "1"}, "default_weight expected a number"),
    ("mine", _ok, {"default_weight": 2.0, "replaces_ce": True}, "default_weight must be <= 1"),
    ("mine", _no_denominator, {"default_weight": 1.0}, "must take `denominator`"),
    ("mine", _required_option, {"default_weight": 1.0}, "parameter 'scale' has no default"),
    ("mine", _kwargs, {"default_weight": 1.0}, "takes *options; options must be named parameters"),
    ("mine", _one_argument, {"default_weight": 1.0}, "must take (stats, vocab) as its first two parameters"),
    ("mine", "not a function", {"default_weight": 1.0}, "fn must be callable"),
    ("mine", _ok, {"default_weight": 1.0, "needs": ("full_vocabulary",)}, "needs ['full_vocabulary'] unknown"),
    ("mine", _ok, {"default_weight": 1.0, "needs": "full_vocab"}, "needs must be a collection of names"),
    ("mine", _ok, {"default_weight": 1.0, "denominator": "digits"}, "denominator 'digits' is not a count"),
    ("mine", _ok, {"default_weight": 1.0, "options": {"sigma": finite(0)}}, "option rules for ['sigma']"),
    ("mine", _ok, {"default_weight": 1.0, "options": {"scale": finite(2)}},
     "the default of option 'scale' breaks its own rule: must be >= 2"),
    ("ce", _ok, {"default_weight": 1.0}, "'ce' is reserved"),
    ("My-Term", _ok, {"default_weight": 1.0}, "lower-case letters, digits and '_'"),
])
def test_a_bad_registration_is_a_clear_error_and_registers_nothing(name, fn, kwargs, message):
    before = registered_terms()
    with pytest.raises(ValueError) as err:
        numloss.register_term(name, fn, **kwargs)
    assert message in str(err.value), str(err.value)
    assert f"register_term({name!r})" in str(err.value)
    assert registered_terms() == before and "mine" not in DEFAULT_WEIGHTS
