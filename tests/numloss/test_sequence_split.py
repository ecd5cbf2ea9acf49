"""Every term on rows split along the sequence over ranks equals the whole rows: real gloo processes.

Each rank builds the same whole rows (labels already shifted, logits), keeps its positions (a contiguous
slice, or Megatron's load-balanced chunks), and runs the objective with the split; the split ranks'
losses must add up to the whole rows' loss, and each rank's gradient must be the whole rows' gradient
at its positions (fp32: 1e-5), for CE and every term, over a step of two micro-batches with the step's
counts summed over the split's ranks. The rows put numbers across the split: a digit run cut between its
digits, a run that starts the second slice, a decimal number whose point is the first slice's last
position, a run on the row's last position, a run over three ranks at sp 4, packed examples. Composed
with tensor parallelism (sp 2 x tp 2 on 4 ranks, a vocab shard per rank) and at a 128,256-wide
vocabulary. The collectives are counted: the step's counts (one SUM), and per micro-batch none at tp 1
but NTIL's one SUM of the straddling runs' partial numbers (when a run straddles), beside the two of tp.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import numloss
from numloss import LossCounts, NumericVocab, Objective, count_comm
from numloss.normalization import reduce_counts
from numloss.sequence_split import SequenceSplit
from tests.distributed import run_ranks
from tests.numloss.tokenizers_fixture import digit_ids, digit_tokenizer

V = 40
DIG = [13, 4, 18, 6, 15, 7, 11, 8, 19, 10]  # DIG[d] is the id of digit d
DOT, IGNORE = 1, -100
TEXT = [t for t in range(V) if t not in DIG and t != DOT]

CASES = {
    "ce": {"terms": {}},
    "ce_zloss": {"terms": {}, "z_loss": 1e-3},
    "smmd": {"terms": {"smmd": {}}},
    "ntl_was": {"terms": {"ntl_was": {}}},
    "ntl_was_reweigh": {"terms": {"ntl_was": {"reweigh": True}}},
    "ntl_mse": {"terms": {"ntl_mse": {}}},
    "dist2_paper": {"terms": {"dist2": {}}},
    "dist2_code": {"terms": {"dist2": {"tau": 2.0, "normalize": "numeric", "weighting": "place_value", "weight": 1.0}}},
    "ntil": {"terms": {"ntil": {"noise_scale": 0.0, "weight": 1.0}}},
    "del": {"terms": {"del": {"weight": 1.0}}},
    "gce": {"terms": {"gce": {}}},
    "gce_half": {"terms": {"gce": {"weight": 0.5, "sigma": 2.0}}},
    "numeric_smoothing": {"terms": {"numeric_smoothing": {}}},
    "numeric_smoothing_code": {"terms": {"numeric_smoothing": {"normalize": "numeric", "weighting": "place_value",
                                                               "weight": 1.0}}},
    "all": {"terms": {"smmd": {}, "ntl_was": {}, "dist2": {"normalize": "numeric", "weighting": "place_value"},
                      "ntil": {"noise_scale": 0.0}, "del": {}}, "z_loss": 1e-4},
}
QUICK = ("ce", "dist2_code", "ntil", "del", "all")  # the cases that read numbers whole, and CE


def _labels(rows: list[str], dig: list[int] = DIG, dot: int = DOT) -> torch.Tensor:
    """Labels (already shifted) from strings: a digit, '.', '_' ignored, 'a' a text token."""
    table = lambda i, c: dig[int(c)] if c.isdigit() else dot if c == "." else IGNORE if c == "_" else TEXT[i % len(TEXT)]
    return torch.tensor([[table(i, c) for i, c in enumerate(r)] for r in rows])


# Two micro-batches of three 16-position rows; "|" marks the split at sp 2 (it is not a position).
MICRO_BATCHES = [
    ["__aaa123|4aa5.6a_",  # 1234 cut between its digits; 5.6 on the second slice
     "aaaaaa_a|789aaa01",  # a run that starts the second slice; a run on the row's last position
     "_aaa456.|25aa3.a_"],  # the first slice ends on the point of 456.25
    ["aaaaaaaa|aaaaaaa_",  # no number at all
     "__a98765|4321aaa_",  # a long run across the split
     "a7aaaaa9|9aaaaa5_"],
]
# sp 4 (slices of 4): a run over three ranks, another starting a slice, one on a slice's end
MICRO_BATCHES_SP4 = [
    ["_a12|3456|7aa8|9.1_", "aaaa|aaa3|aaaa|aa4_", "__aa|aaaa|aaaa|aaa_"],
    ["a1a2|a3a4|a5a6|a7a_", "9999|9999|9999|999_", "aa.5|5aaa|a5.5|aa5_"],
]


def _rows(batch: list[str]) -> list[str]:
    return [r.replace("|", "") for r in batch]


def _groups(world: int, sp: int, tp: int):
    """(sp rank, sp group, tp rank, tp group) of this rank: rank = sp_rank x tp + tp_rank; every rank
    creates every group in the same order, as torch requires."""
    rank = dist.get_rank()
    sp_groups = [dist.new_group([s * tp + t for s in range(sp)]) for t in range(tp)]
    tp_groups = [dist.new_group([s * tp + t for t in range(tp)]) for s in range(sp)]
    sp_rank, tp_rank = divmod(rank, tp)
    return sp_rank, sp_groups[tp_rank], tp_rank, (tp_groups[sp_rank] if tp > 1 else None)


def _shard(width: int, tp: int, tp_rank: int) -> tuple[int, int]:
    per = -(-width // tp)
    return tp_rank * per, min((tp_rank + 1) * per, width)


def _run_case(objective: Objective, batches: list[torch.Tensor], width: int, sp_rank: int, sp: int, sp_group,
              tp_rank: int, tp: int, tp_group, make_split, packed: list[torch.Tensor] | None = None) -> dict:
    """Whole rows vs. this rank's split positions, one step of `batches`; returns what was compared."""
    generator = torch.Generator().manual_seed(7)
    logits = [torch.randn(*labels.shape, width, generator=generator) * 2 for labels in batches]
    ids = packed or [None] * len(batches)
    # the whole rows, on this process alone
    whole_counts = LossCounts.total(objective.counts(labels, ids[i]) for i, labels in enumerate(batches))
    ref_loss, ref_grads, ref_terms = 0.0, [], {}
    for x, labels, seq in zip(logits, batches, ids):
        leaf = x.clone().requires_grad_(True)
        out = objective(leaf, labels, counts=whole_counts, sequence_ids=seq)
        out.loss.backward()
        ref_loss += float(out.loss)
        ref_grads.append(leaf.grad)
        for k, v in out.terms.items():
            ref_terms[k] = ref_terms.get(k, 0.0) + float(v)
    # split: this rank's positions and vocab shard
    splits = [make_split(labels, sp_rank, sp, sp_group, seq) for labels, seq in zip(batches, ids)]
    start, end = _shard(width, tp, tp_rank)
    with count_comm() as comm:
        step = reduce_counts([objective.counts(s.local(s.labels), sequence_split=s) for s in splits], group=sp_group)
    assert step.values == whole_counts.values  # each row, sequence and place weight counted once
    assert comm.ops() == ["all_reduce_sum"]
    loss, terms, per_batch_ops = torch.zeros(()), {}, []
    for x, split, ref_grad in zip(logits, splits, ref_grads):
        leaf = split.local(x.transpose(-1, -2)).transpose(-1, -2)[..., start:end].clone().requires_grad_(True)
        with count_comm() as comm:
            out = objective(leaf, split.local(split.labels), group=tp_group, vocab_start=start, counts=step,
                            sequence_split=split)
            out.loss.backward()
        per_batch_ops.append(comm.ops())
        expected = split.local(ref_grad.transpose(-1, -2)).transpose(-1, -2)[..., start:end]
        torch.testing.assert_close(leaf.grad, expected, rtol=1e-5, atol=1e-6)
        loss = loss + out.loss.detach()
        for k, v in out.terms.items():
            terms[k] = terms.get(k, torch.zeros(())) + v.detach()
    together = torch.stack([loss, *terms.values()]).double()
    dist.all_reduce(together, group=sp_group)  # the split ranks' shares add up
    torch.testing.assert_close(together[0].item(), ref_loss, rtol=1e-5, atol=1e-6)
    for (k, _), v in zip(terms.items(), together[1:].tolist()):
        torch.testing.assert_close(v, ref_terms[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"term {k}: {m}")
    return {"ops": per_batch_ops}


def _expected_calls(objective: Objective, splits_straddle: list[bool], tp: int, layout_exchange: bool) -> list[int]:
    """Collectives per micro-batch: tp's two (MAX, then a SUM or an all-gather by the cheaper route; the first
    call on a new shard layout also all-gathers the layout once), NTIL's one SUM when a run straddles."""
    ntil = "ntil" in objective.config.terms
    calls = [2 * (tp > 1) + (ntil and straddle) for straddle in splits_straddle]
    calls[0] += layout_exchange
    return calls


def _straddles(batch: list[str]) -> bool:
    """Whether a digit run of the rows crosses a '|' (NTIL's runs are digits only)."""
    return any(r[i - 1].isdigit() and r[i + 1].isdigit() for r in batch for i, c in enumerate(r) if c == "|")


def _check_split(rank, world, sp, tp, width, names, batches_text, load_balanced=False):
    sp_rank, sp_group, tp_rank, tp_group = _groups(world, sp, tp)
    if width == V:
        dig, dot = DIG, DOT
    else:  # a real-size vocabulary: the digit tokenizer's digits in a 128,256-wide logits row
        dig, dot = [digit_ids(digit_tokenizer())[d] for d in range(10)], digit_tokenizer().token_to_id(".")
    vocab = NumericVocab(dig, [float(d) for d in range(10)], vocab_size=width, decimal_point_id=dot)
    batches = [_labels(_rows(b), dig, dot) for b in batches_text]
    make = SequenceSplit.load_balanced if load_balanced else SequenceSplit.contiguous
    for i, name in enumerate(names):
        objective = Objective(vocab, CASES[name])
        seen = _run_case(objective, batches, width, sp_rank, sp, sp_group, tp_rank, tp, tp_group,
                         lambda labels, r, w, g, seq: make(labels, r, w, g, seq))
        if not load_balanced:
            calls = _expected_calls(objective, [_straddles(b) for b in batches_text], tp, i == 0 and tp > 1)
            assert [len(ops) for ops in seen["ops"]] == calls, (name, seen["ops"])
            if "ntil" in objective.config.terms and tp == 1:  # NTIL's own: one SUM, only where a run straddles
                assert seen["ops"] == [["all_reduce_sum"] if c else [] for c in calls]


@pytest.mark.parametrize("names", [list(CASES)], ids=["every_term"])
def test_sp2_equals_whole_rows(names):
    run_ranks(2, _check_split, 2, 1, V, names, MICRO_BATCHES)


def test_sp2_tp2_on_four_ranks():
    run_ranks(4, _check_split, 2, 2, V, list(QUICK), MICRO_BATCHES)


def test_sp4_run_over_three_ranks():
    run_ranks(4, _check_split, 4, 1, V, list(QUICK), MICRO_BATCHES_SP4)


def test_sp2_real_size_vocabulary():
    run_ranks(2, _check_split, 2, 1, 128_256, ["all", "gce"], MICRO_BATCHES[:1])


def test_load_balanced_split_matches():
    """Megatron's context-parallel order: rank r holds chunks r and 2·cp - 1 - r (not contiguous)."""
    run_ranks(2, _check_split, 2, 1, V, list(QUICK), MICRO_BATCHES, True)


def _check_packed(rank, world):
    sp_rank, sp_group, _, _ = _groups(world, 2, 1)
    vocab = NumericVocab(DIG, [float(d) for d in range(10)], vocab_size=V, decimal_point_id=DOT)
    rows = ["a12_a34a|5a_a6789", "aaa_a123|4567_aa1"]  # '_' opens each packed example
    batches = [_labels(_rows(rows))]
    seq = torch.tensor([[0] * 3 + [1] * 7 + [2] * 6, [0] * 3 + [1] * 9 + [2] * 4])
    for name in ("ntil", "dist2_code", "del", "ce"):
        objective = Objective(vocab, CASES[name])
        _run_case(objective, batches, V, sp_rank, 2, sp_group, 0, 1, None,
                  lambda labels, r, w, g, s: SequenceSplit.contiguous(labels, r, w, g, s), packed=[seq])


def test_packed_rows_split():
    run_ranks(2, _check_packed)


def _check_refusals(rank, world):
    vocab = NumericVocab(DIG, [float(d) for d in range(10)], vocab_size=V, decimal_point_id=DOT)
    labels = _labels(_rows(MICRO_BATCHES[0]))
    split = SequenceSplit.contiguous(labels, rank, world, dist.group.WORLD)
    logits = torch.zeros(*split.local(labels).shape, V)
    # a user's term not declared exact under a split
    numloss.register_term("split_probe", lambda stats, vocab, *, denominator=None: stats.lse.sum() * 0,
                          default_weight=0.1)
    try:
        with pytest.raises(ValueError, match="terms.split_probe: not registered as exact under a sequence split"):
            Objective(vocab, {"terms": {"split_probe": {}}})(logits, split.local(labels), sequence_split=split)
    finally:
        numloss.unregister_term("split_probe")
    with pytest.raises(ValueError, match="terms.ntil.rescale_to_ce"):
        Objective(vocab, {"terms": {"ntil": {"rescale_to_ce": True}}})(logits, split.local(labels), sequence_split=split)
    with pytest.raises(ValueError, match="not this rank's positions"):
        Objective(vocab, CASES["ce"])(logits, labels[:, :8].flip(-1), sequence_split=split)


def test_refusals():
    run_ranks(2, _check_refusals)


def test_a_split_without_a_group_cannot_exchange():
    """Positions on two ranks but no group: labels-only terms work, NTIL's straddling run is an error."""
    vocab = NumericVocab(DIG, [float(d) for d in range(10)], vocab_size=V, decimal_point_id=DOT)
    labels = _labels(_rows(MICRO_BATCHES[0]))
    split = SequenceSplit.contiguous(labels, 0, 2)
    logits = torch.zeros(*split.local(labels).shape, V)
    Objective(vocab, CASES["dist2_code"])(logits, split.local(labels), sequence_split=split)
    with pytest.raises(ValueError, match="no process group"):
        Objective(vocab, CASES["ntil"])(logits, split.local(labels), sequence_split=split)


def test_uneven_rows_are_refused():
    with pytest.raises(ValueError, match="does not split evenly over 3 ranks"):
        SequenceSplit.contiguous(torch.zeros(2, 16, dtype=torch.long), 0, 3)
    with pytest.raises(ValueError, match="2 x the context-parallel size"):
        SequenceSplit.load_balanced(torch.zeros(2, 6, dtype=torch.long), 0, 2)


def test_one_rank_split_is_the_whole_row():
    """World 1: the split is the identity, the objective's value and gradient unchanged (to the bit)."""
    vocab = NumericVocab(DIG, [float(d) for d in range(10)], vocab_size=V, decimal_point_id=DOT)
    labels = _labels(_rows(MICRO_BATCHES[0]))
    split = SequenceSplit.contiguous(labels, 0, 1)
    x = torch.randn(*labels.shape, V, generator=torch.Generator().manual_seed(3))
    objective = Objective(vocab, CASES["all"])
    a, b = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    objective(a, labels).loss.backward()
    objective(b, labels, sequence_split=split).loss.backward()
    assert torch.equal(a.grad, b.grad)
