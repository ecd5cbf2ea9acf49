"""Step-global loss normalisation (`numloss.normalization`): the micro-batches of a step, given the
step's counts, add up to the loss and gradient of the whole batch at once; without counts nothing
changes; the counts are the ones the terms divide by; two gloo ranks reduce them into the dense value;
NTIL on packed rows equals NTIL on the same examples as separate rows."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from numloss import NumericVocab, Objective, compute_logit_stats
from numloss.losses import ntl_mse_term, ntl_was_term
from numloss.normalization import LossCounts, batch_counts, reduce_counts
from tests.distributed import run_ranks
from tests.numloss import numeric_reference as R

pytestmark = pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")

V = 20
DIG = [13, 4, 18, 6, 15, 7, 11, 8, 19, 10]  # DIG[d] is the id of digit d
DOT, NONNUM = 1, 2
ALL = {"ntl_was": {}, "ntl_mse": {"loss": "huber"}, "gce": {"weight": 0.5}, "ntil": {"noise_scale": 0.0},
       "smmd": {}, "dist2": {"weighting": "place_value", "normalize": "numeric"}}


def vocab():
    return NumericVocab(DIG, [float(d) for d in range(10)], vocab_size=V)


def batch(rows=8, seq=9, seed=0):
    """Rows with very different numeric counts (0 to 8) and fully ignored rows: the case a per-batch
    mean weighs wrongly."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, seq, V, generator=g, dtype=torch.float64) * 3
    pool = DIG + [NONNUM, DOT, 0, 3, -100]
    labels = torch.tensor(pool)[torch.randint(len(pool), (rows, seq), generator=g)]
    labels[0] = torch.tensor([DIG[d] for d in (1, 0, 2, 4, 0, 9, 3, 3)] + [DOT])  # a long run
    labels[1] = -100  # nothing to learn from
    labels[2] = torch.tensor([NONNUM] * seq)  # valid, not numeric
    return logits, labels


def objective(z_loss=0.01):
    return Objective(vocab(), {"terms": {k: dict(v) for k, v in ALL.items()}, "z_loss": z_loss})


def run(obj, logits, labels, counts=None, sequence_ids=None):
    x = logits.float().clone().requires_grad_()
    out = obj(x, labels, counts=counts, sequence_ids=sequence_ids)
    out.loss.backward()
    return out, x.grad


@pytest.mark.parametrize("split", [[8], [4, 4], [1, 3, 4], [2, 2, 2, 2]])
def test_micro_batches_add_up_to_the_whole_batch(split):
    obj = objective()
    logits, labels = batch()
    whole, whole_grad = run(obj, logits, labels)
    step = LossCounts.total(obj.counts(lab) for lab in labels.split(split))
    assert step == obj.counts(labels)
    parts = [run(obj, x, lab, counts=step) for x, lab in zip(logits.split(split), labels.split(split))]
    total = sum(out.loss for out, _ in parts)
    assert float(total) == pytest.approx(float(whole.loss), rel=1e-6)
    for name in ALL:
        assert float(sum(out.terms[name] for out, _ in parts)) == pytest.approx(float(whole.terms[name]),
                                                                                 rel=1e-6, abs=1e-7), name
    assert float(sum(out.ce for out, _ in parts)) == pytest.approx(float(whole.ce), rel=1e-6)
    grad = torch.cat([g for _, g in parts])
    torch.testing.assert_close(grad, whole_grad, rtol=1e-5, atol=1e-7)
    if len(split) > 1:  # the per-micro-batch mean (each part its own counts, then averaged) differs
        own = sum(float(run(obj, x, lab)[0].loss) for x, lab in zip(logits.split(split), labels.split(split)))
        assert abs(own / len(split) - float(whole.loss)) > 1e-5 * abs(float(whole.loss))  # 10x the tolerance


def test_the_split_sum_matches_the_float64_reference():
    """Against the independent reference on the whole batch: DIST2 place value (sum w*KL / sum w), NTL
    with position weights (sum w*l / sum w), NTIL, over micro-batches of very different sizes."""
    v, logits, labels = vocab(), *batch(seed=3)
    ids, vals = DIG, [float(d) for d in range(10)]
    split = [1, 5, 2]
    obj = Objective(v, {"terms": {"dist2": {"weighting": "place_value"}, "ntil": {"noise_scale": 0.0}}})
    step = LossCounts.total(obj.counts(lab) for lab in labels.split(split))
    parts = [obj(x.float(), lab, counts=step) for x, lab in zip(logits.split(split), labels.split(split))]
    ref_dist2 = float(R.dist2(logits, labels, ids, vals, weighting="place_value"))
    assert float(sum(p.terms["dist2"] for p in parts)) == pytest.approx(ref_dist2, rel=2e-5)
    ref_ntil = float(R.ntil(logits, labels, ids, vals))
    assert float(sum(p.terms["ntil"] for p in parts)) == pytest.approx(ref_ntil, rel=2e-5)

    weights = torch.linspace(0.1, 4.0, labels.numel()).reshape(labels.shape)
    for term, ref in ((ntl_was_term, R.ntl_was), (ntl_mse_term, R.ntl_mse)):
        key = f"{term.__name__.removesuffix('_term')}.position_weights"
        total = LossCounts.total(batch_counts(lab, v, [key], position_weights={key: w})
                                 for lab, w in zip(labels.split(split), weights.split(split)))
        got = sum(term(compute_logit_stats(x.float(), lab, v), v, position_weights=w, denominator=total[key])
                  for x, lab, w in zip(logits.split(split), labels.split(split), weights.split(split)))
        assert float(got) == pytest.approx(float(ref(logits, labels, ids, vals, position_weights=weights)),
                                           rel=2e-5), key


def test_without_counts_nothing_changes_and_own_counts_are_the_same_bits():
    """One micro-batch on one rank: the step's counts are the batch's own, and the value is exactly
    what the objective gives without counts (what it gave before global normalisation)."""
    obj = objective()
    logits, labels = batch(seed=1)
    plain, plain_grad = run(obj, logits, labels)
    counted, counted_grad = run(obj, logits, labels, counts=obj.counts(labels))
    assert torch.equal(plain.loss, counted.loss)
    assert all(torch.equal(plain.terms[k], counted.terms[k]) for k in ALL)
    assert torch.equal(plain_grad, counted_grad)


def test_counts_are_what_each_term_divides_by():
    obj = objective()
    logits, labels = batch(seed=2)
    c = obj.counts(labels)
    numeric = sum(int((labels == t).sum()) for t in DIG)
    assert c["tokens"] == int((labels != -100).sum())
    assert c["numeric"] == numeric
    assert c["sequences"] == 7  # row 1 holds no valid label
    # row 0's run of eight digits weighs 8+7+...+1 = 36 in DIST2's place value
    assert c["place_value"] >= 36 + (numeric - 8)
    assert obj.denominator_keys() == {"ce": "tokens", "ntl_was": "numeric", "ntl_mse": "numeric", "gce": "tokens",
                                      "ntil": "sequences", "smmd": "numeric", "dist2": "place_value"}
    with pytest.raises(KeyError, match="has no count 'sequences'"):
        obj(logits.float(), labels, counts=LossCounts({"tokens": 1.0, "numeric": 1.0, "place_value": 1.0}))
    with pytest.raises(ValueError, match="different kinds"):
        LossCounts({"tokens": 1.0}) + LossCounts({"numeric": 1.0})


def test_ntil_on_packed_rows_equals_separate_rows():
    """Two examples packed in one row (sequence ids 1, 2; the second's first label ignored, as
    data_prep packs) score as the same two examples in two rows; without sequence ids the packed row
    is one sequence and scores differently."""
    v = vocab()
    g = torch.Generator().manual_seed(5)
    a = torch.tensor([NONNUM, DIG[4], DIG[0], DIG[7], DOT, -100])
    b = torch.tensor([-100, DIG[9], DOT, NONNUM, DIG[1], DIG[2]])
    la, lb = torch.randn(6, V, generator=g) * 3, torch.randn(6, V, generator=g) * 3
    obj = Objective(v, {"terms": {"ntil": {"noise_scale": 0.0}}})
    separate = obj(torch.stack([la, lb]), torch.stack([a, b]))
    packed_labels, packed_logits = torch.cat([a, b])[None], torch.cat([la, lb])[None]
    segments = torch.tensor([[1] * 6 + [2] * 6])
    packed = obj(packed_logits, packed_labels, sequence_ids=segments)
    assert float(packed.terms["ntil"]) == pytest.approx(float(separate.terms["ntil"]), rel=1e-6)
    assert obj.counts(packed_labels, segments)["sequences"] == 2
    unsegmented = obj(packed_logits, packed_labels)
    assert abs(float(unsegmented.terms["ntil"]) - float(separate.terms["ntil"])) > 1e-3
    with pytest.raises(ValueError, match="sequence_ids"):
        obj(packed_logits, packed_labels, sequence_ids=segments[:, :5])


def _two_ranks(rank, world):
    """Each rank holds a different, unevenly sized part of the batch (3 and 5 rows, split into 1+2 and
    5 micro-batches); after one all-reduce of the counts, the sum over ranks and micro-batches of
    the loss and each row's gradient equal the dense whole-batch value."""
    obj = objective()
    logits, labels = batch(seed=4)
    whole, whole_grad = run(obj, logits, labels)
    mine = [slice(0, 1), slice(1, 3)] if rank == 0 else [slice(3, 8)]
    step = reduce_counts([obj.counts(labels[s]) for s in mine])
    assert step == obj.counts(labels)
    total = torch.zeros(1, dtype=torch.float64)
    for s in mine:
        out, grad = run(obj, logits[s], labels[s], counts=step)
        total += float(out.loss)
        torch.testing.assert_close(grad, whole_grad[s], rtol=1e-5, atol=1e-7)
    dist.all_reduce(total)
    assert float(total) == pytest.approx(float(whole.loss), rel=1e-6)


def test_counts_reduced_over_two_gloo_ranks():
    run_ranks(2, _two_ranks)
