"""DEL, the Digit Entropy Loss: its place weights on hand cases, value and gradient against the float64
reference written from the definition (`numeric_reference.digit_entropy`, loops), the common contract
(no digit position: a finite 0 with a zero gradient; weight 0: CE exactly; bf16 at a 151k vocabulary),
the vocabularies it refuses, and the same value on the chunked head and over micro-batches x
data-parallel ranks with the step's counts. Tensor-parallel: tests/numloss/test_parallel.py; the
fused pass: tests/numloss/fused_interpreted.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import numloss
from numloss import NumericVocab, Objective, ObjectiveConfig
from numloss import functional as F
from numloss.logit_stats import compute_logit_stats
from numloss.losses.digit_entropy import digit_places
from tests.distributed import run_ranks
from tests.numloss import numeric_reference as R
from tests.numloss.tokenizers_fixture import digit_tokenizer, llama3_tokenizer, word_level

pytestmark = pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")

V = 24
DIG = [13, 4, 18, 6, 15, 7, 11, 8, 19, 10]  # DIG[d] is the id of digit d
DOT, NONNUM, DASH = 1, 2, 3
IGNORE = -100


@pytest.fixture(scope="module")
def dig():
    return NumericVocab(DIG, [float(d) for d in range(10)], vocab_size=V, decimal_point_id=DOT)


def _text(text: str) -> list[int]:
    """Labels from a string: digits, '.', '-', '_' ignored, anything else a non-numeric token."""
    table = {".": DOT, "-": DASH, "_": IGNORE}
    return [DIG[int(c)] if c.isdigit() else table.get(c, NONNUM) for c in text]


def _places(vocab, rows: list[str], point=DOT) -> list[list[float]]:
    """numloss's place weights of each row's digits (rows padded with ignored labels)."""
    width = max(map(len, rows))
    labels = torch.tensor([_text(r) + [IGNORE] * (width - len(r)) for r in rows])
    stats = compute_logit_stats(torch.zeros(*labels.shape, V), labels, vocab)
    weights = digit_places(stats, point).tolist()
    out, k = [], 0
    for r in rows:
        n = sum(c.isdigit() for c in r)
        out.append(weights[k:k + n])
        k += n
    return out


# ---- the place weights --------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, weights", [
    ("123", [6, 4, 2]),
    ("12.55", [4, 2, 1.02 ** -2, 1.02 ** -3]),
    ("x.5", [2]),                                  # a run that starts with the point counts as an integer
    (".25", [4, 2]),
    (".4.5", [6, 2]),                              # the whole run: its later point is no decimal point
    ("the 12.", [4, 2]),                           # a sentence's period after the last digit changes nothing
    ("3.14.", [2, 1.02 ** -2, 1.02 ** -3]),
    ("1.2.3", [2, 1.02 ** -2, 1.02 ** -4]),        # places count tokens: the second point takes one
    ("12_34", [4, 2, 4, 2]),                       # an ignored label ends a run
    ("7-40", [2, 4, 2]),                           # so does any other label
    ("0", [2]),
])
def test_place_weights_of_hand_cases(dig, text, weights):
    assert _places(dig, [text]) == [pytest.approx(weights, rel=1e-7)]
    reference = [w for w in R.digit_places(_text(text), DIG, DOT) if w is not None]
    assert reference == pytest.approx(weights, rel=1e-12)


def test_runs_stay_inside_a_row(dig):
    # "12" ending row 0 and "3.5" opening row 1 are two numbers, not "123.5"
    assert _places(dig, ["ab12", "3.5cd"]) == [[4, 2], [2, pytest.approx(1.02 ** -2)]]


def test_without_a_decimal_point_every_run_is_an_integer(dig):
    assert _places(dig, ["12.55"], point=None) == [[4, 2, 4, 2]]


def test_place_weights_equal_the_reference_on_random_labels(dig):
    g = torch.Generator().manual_seed(0)
    pool = torch.tensor(DIG * 3 + [DOT, DOT, NONNUM, DASH, IGNORE])
    labels = pool[torch.randint(len(pool), (40, 23), generator=g)]
    stats = compute_logit_stats(torch.zeros(*labels.shape, V), labels, dig)
    reference = [w for row in labels.tolist() for w in R.digit_places(row, DIG, DOT) if w is not None]
    assert len(reference) > 300
    torch.testing.assert_close(digit_places(stats, DOT), torch.tensor(reference, dtype=torch.float32),
                               rtol=1e-7, atol=0)


# ---- value and gradient against the float64 reference ----------------------------------------------------------


def _batch(seed=0, rows=4, seq=12, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, seq, V, generator=g) * scale
    pool = torch.tensor(DIG * 2 + [DOT, NONNUM, DASH, 0, 5, IGNORE])
    labels = pool[torch.randint(len(pool), (rows, seq), generator=g)]
    labels[0, :6] = torch.tensor(_text("12.55_"))
    labels[1, -3:] = torch.tensor(_text("407"))  # a number that runs to the row's end
    return logits, labels


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_value_and_gradient_equal_the_float64_reference(dig, seed):
    logits, labels = _batch(seed)
    x = logits.clone().requires_grad_(True)
    value = F.digit_entropy(x, labels, dig)
    value.backward()
    xd = logits.double().requires_grad_(True)
    reference = R.digit_entropy(xd, labels, DIG, DOT)
    reference.backward()
    assert value.item() == pytest.approx(reference.item(), rel=1e-5)
    torch.testing.assert_close(x.grad, xd.grad.float(), rtol=1e-4, atol=1e-7)
    # the decimal point may also be given to the call (a vocabulary without one)
    plain = NumericVocab(DIG, [float(d) for d in range(10)], vocab_size=V)
    assert F.digit_entropy(logits, labels, plain, DOT).item() == pytest.approx(reference.item(), rel=1e-5)
    assert F.digit_entropy(logits, labels, plain).item() == pytest.approx(
        R.digit_entropy(logits.double(), labels, DIG, None).item(), rel=1e-5)


def test_objective_total_is_ce_plus_a_hundredth_of_del(dig):
    logits, labels = _batch(3)
    assert numloss.DEFAULT_WEIGHTS["del"] == 0.01
    objective = Objective(dig, {"terms": {"del": {}}})
    x = logits.clone().requires_grad_(True)
    out = objective(x, labels)
    out.loss.backward()
    xd = logits.double().requires_grad_(True)
    reference = R.ce(xd, labels) + 0.01 * R.digit_entropy(xd, labels, DIG, DOT)
    reference.backward()
    assert out.terms["del"].item() == pytest.approx(R.digit_entropy(logits.double(), labels, DIG, DOT).item(), rel=1e-5)
    assert out.loss.item() == pytest.approx(reference.item(), rel=1e-6)
    torch.testing.assert_close(x.grad, xd.grad.float(), rtol=1e-4, atol=1e-7)


# ---- the common contract ---------------------------------------------------------------------------------------


def test_no_digit_position_is_a_finite_zero_with_zero_gradient(dig):
    logits = torch.randn(2, 6, V) * 3
    labels = torch.tensor([_text("ab.c-_"), _text("__..x_")])
    x = logits.clone().requires_grad_(True)
    value = F.digit_entropy(x, labels, dig)
    value.backward()
    assert value.item() == 0.0 and torch.isfinite(value)
    assert torch.equal(x.grad, torch.zeros_like(x))
    out = Objective(dig, {"terms": {"del": 1.0}})(logits, labels)
    assert out.terms["del"].item() == 0.0 and out.numeric_positions == 0
    ignored = Objective(dig, {"terms": {"del": 1.0}})(logits, torch.full_like(labels, IGNORE))
    assert ignored.loss.item() == 0.0


def test_weight_zero_is_exactly_cross_entropy(dig):
    logits, labels = _batch(4)
    runs = {}
    for name, config in (("ce", {"terms": {}}), ("del0", {"terms": {"del": 0.0}})):
        x = logits.clone().requires_grad_(True)
        out = Objective(dig, config)(x, labels)
        out.loss.backward()
        runs[name] = (out.loss.detach(), x.grad)
    assert torch.equal(runs["ce"][0], runs["del0"][0]) and torch.equal(runs["ce"][1], runs["del0"][1])


def test_finite_in_bf16_at_a_151k_vocabulary():
    v = 151_936  # Qwen2.5's logits width
    digits = list(range(15, 25))  # Qwen2.5's "0".."9"
    vocab = NumericVocab(digits, [float(d) for d in range(10)], vocab_size=v, decimal_point_id=13)
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(2, 12, v, generator=g) * 4).bfloat16()
    labels = torch.tensor([[15 + d for d in (1, 2)] + [13] + [15 + d for d in (5, 5)] + [220] * 7,
                           [IGNORE] * 4 + [15 + d for d in (4, 0, 7)] + [13, 220, 15 + 9, 15, 151_000]])
    logits[0, 0, 15:25] = torch.tensor([-3e4, 3e4] + [0.0] * 8, dtype=torch.bfloat16)  # a saturated row
    x = logits.clone().requires_grad_(True)
    out = Objective(vocab, {"terms": {"del": 1.0}})(x, labels)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(out.terms["del"]) and out.terms["del"] > 0
    assert x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad.float()).all()
    fp32 = Objective(vocab, {"terms": {"del": 1.0}})(logits.float(), labels)  # the same bf16 values in fp32
    assert out.terms["del"].item() == pytest.approx(fp32.terms["del"].item(), rel=1e-5)


# ---- what it refuses, before any model ---------------------------------------------------------------------------


def test_vocabularies_that_are_not_the_ten_digits_are_refused_when_the_objective_is_made(dig):
    integers = NumericVocab(list(range(100, 1100)), [float(v) for v in range(1000)], decimal_point_id=5)
    with pytest.raises(ValueError, match="term 'del' needs exactly the ten digit tokens 0..9"):
        Objective(integers, {"terms": {"del": {}}})
    spaced = NumericVocab(list(range(30, 50)), [float(d % 10) for d in range(20)], decimal_point_id=5)
    with pytest.raises(ValueError, match="term 'del' needs exactly the ten digit tokens"):
        Objective(spaced, {"terms": {"del": {}}})
    no_point = NumericVocab(DIG, [float(d) for d in range(10)], vocab_size=V)
    with pytest.raises(ValueError, match="term 'del' needs the decimal point's token id"):
        Objective(no_point, {"terms": {"del": {}}})
    Objective(no_point, {"terms": {"del": {"decimal_point_id": DOT}}})  # given to the term instead
    for bad, words in (("1", "expected a token id"), (-1, "expected a token id"), (True, "expected a token id")):
        with pytest.raises(ValueError, match=f"loss.objective.terms.del.decimal_point_id: {words}"):
            ObjectiveConfig.from_dict({"terms": {"del": {"decimal_point_id": bad}}}, root="loss.objective")
    with pytest.raises(ValueError, match="decimal_point_id 13 is one of the numeric tokens"):
        NumericVocab(DIG, [float(d) for d in range(10)], decimal_point_id=DIG[0])


def test_the_decimal_point_comes_from_the_tokenizer():
    tokenizer = digit_tokenizer()
    vocab = NumericVocab.from_tokenizer(tokenizer, "digits")
    assert vocab.decimal_point_id == tokenizer.get_vocab()["."] and vocab.is_ten_digits()
    Objective(vocab, {"terms": {"del": {}}})  # no key needed
    llama = NumericVocab.from_tokenizer(llama3_tokenizer(), "integers")
    with pytest.raises(ValueError, match="term 'del' needs exactly the ten digit tokens 0..9"):
        Objective(llama, {"terms": {"del": {}}})
    no_point = NumericVocab.from_tokenizer(word_level(("<unk>", "a", "0", "1", "2", "3", "4", "5", "6", "7", "8",
                                                       "9")), "digits")
    assert no_point.decimal_point_id is None
    with pytest.raises(ValueError, match="needs the decimal point's token id"):
        Objective(no_point, {"terms": {"del": {}}})


def test_per_term_gradient_diagnostics_see_del(dig):
    logits, labels = _batch(8)
    objective = Objective(dig, {"terms": {"del": {}, "smmd": {}}})
    plain = objective(logits, labels)
    out = objective(logits, labels, diagnostics=True)
    assert torch.equal(out.loss, plain.loss)
    # DEL's block: the gradient of 0.01 x DEL on the digit columns at the digit positions (its whole gradient)
    x = logits.clone().requires_grad_(True)
    (0.01 * F.digit_entropy(x, labels, dig)).backward()
    rows = torch.isin(labels.reshape(-1), torch.tensor(DIG))
    block = x.grad.reshape(-1, V)[rows][:, DIG]
    assert torch.count_nonzero(x.grad.reshape(-1, V)[~rows]) == 0
    assert float(out.grad_sums["grad_sums/del/sq"]) == pytest.approx(float(block.double().square().sum()), rel=1e-5)
    assert float(out.grad_sums["grad_sums/del/off_sq_max"]) == 0.0  # it reads no log-sum-exp
    shares = numloss.diagnostics.finalize(out.log_dict())
    assert 0 < shares["grad/del/share"] < 1 and shares["grad/del/cos_ce"] is not None


# ---- every path: the chunked head, micro-batches x data-parallel ranks -------------------------------------------


def test_chunked_head_equals_the_logits_path(dig):
    _, labels = _batch(6)
    g = torch.Generator().manual_seed(6)
    hidden, weight = torch.randn(*labels.shape, 16, generator=g), torch.randn(V, 16, generator=g) / 2
    objective = Objective(dig, {"terms": {"del": 1.0}})
    results = []
    for chunked in (False, True):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = objective.from_hidden(h, w, labels, chunk_size=5) if chunked else objective(h @ w.t(), labels)
        out.loss.backward()
        results.append((out.terms["del"].detach(), out.loss.detach(), h.grad, w.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _data_parallel_rank(rank: int, world: int):
    """Each of `world` ranks takes two micro-batches of the global batch; with the step's counts the
    shares add up to the whole batch's loss and gradient."""
    vocab = NumericVocab(DIG, [float(d) for d in range(10)], vocab_size=V, decimal_point_id=DOT)
    logits, labels = _batch(7, rows=2 * 2 * world, seq=10)
    labels[3] = IGNORE  # a micro-batch row without a label, one with few digits
    labels[5, :8] = torch.tensor(_text("ab___c.d"))
    objective = Objective(vocab, {"terms": {"del": 1.0}})
    x = logits.clone().requires_grad_(True)
    whole = objective(x, labels)
    whole.loss.backward()
    mine = [slice(2 * (2 * rank + k), 2 * (2 * rank + k) + 2) for k in range(2)]  # rows of my micro-batches
    step = numloss.reduce_counts([objective.counts(labels[m]) for m in mine], group=dist.group.WORLD)
    assert step["numeric"] == whole.numeric_positions
    y = logits.clone().requires_grad_(True)
    total, term = torch.zeros(()), torch.zeros(())
    for m in mine:
        out = objective(y[m], labels[m], counts=step)
        out.loss.backward()
        total, term = total + out.loss.detach(), term + out.terms["del"].detach()
    for value in (total, term, y.grad):
        dist.all_reduce(value)
    torch.testing.assert_close(total, whole.loss.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(term, whole.terms["del"].detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(y.grad, x.grad, rtol=1e-5, atol=1e-8)


def test_micro_batches_on_data_parallel_ranks_equal_one_batch():
    run_ranks(2, _data_parallel_rank)
