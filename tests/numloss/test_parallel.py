"""Every loss on tensor-parallel logit shards equals the dense computation: real gloo processes.

Each rank builds the same full logits, keeps its vocab slice, and runs the objective with the TP group;
the loss and the gradient of its slice must match the dense single-process run (fp32: 1e-6). Layouts
cover a vocab not divisible by TP, numeric columns spread over ranks, all in rank 0, and none in some
ranks, by both routes the numeric columns can take (riding in the SUM all-reduce, or in the all-gather).
The collectives of one step are counted and their bytes asserted exactly: two per step, whatever the terms,
from logits or from hidden states (the chunked head, which adds d hidden's all-reduce in backward).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import numloss.logit_stats
import numloss.parallel
from numloss import NumericVocab, Objective, count_comm, functional
from numloss.losses import term_spec
from numloss.parallel import ShardLayout, choose_route
from tests.distributed import run_ranks

V = 37  # not divisible by 2 or 4

# name -> (numeric token ids, values)
VOCABS = {
    "spread": ([1, 5, 12, 19, 22, 25, 30, 33, 35, 36], [3, 0, 9, 1, 4, 7, 2, 8, 6, 5]),  # digits, every rank
    "rank0": (list(range(2, 12)), list(range(10))),  # digits, all inside rank 0's slice
    "first_half": ([0, 3, 4, 8, 14, 17], [0.5, 2.0, 10.0, 12.0, 407.0, 2.0]),  # none in the last ranks
}

# name -> objective config; ntil and del only run on the digit vocabularies (0 is a text token there: del's
# decimal point)
CASES = {
    "ce": {"terms": {}},
    "ce_zloss": {"terms": {}, "z_loss": 1e-3},
    "ntl_was": {"terms": {"ntl_was": {}}},
    "ntl_was_squash_reweigh": {"terms": {"ntl_was": {"squash_factor": 3.0, "reweigh": True}}},
    "ntl_mse": {"terms": {"ntl_mse": {}}},
    "ntl_mae_reweigh": {"terms": {"ntl_mse": {"loss": "mae", "reweigh": True}}},
    "ntl_huber": {"terms": {"ntl_mse": {"loss": "huber"}}},
    "gce": {"terms": {"gce": {}}},
    "gce_sigma0": {"terms": {"gce": {"sigma": 0.0}}},
    "gce_renorm_half": {"terms": {"gce": {"weight": 0.5, "renormalize": True, "sigma": 2.0}}},
    "dist2_paper": {"terms": {"dist2": {}}},
    "dist2_code": {"terms": {"dist2": {"tau": 2.0, "normalize": "numeric", "weighting": "place_value", "weight": 1.0}}},
    "numeric_smoothing": {"terms": {"numeric_smoothing": {}}},
    "numeric_smoothing_code": {"terms": {"numeric_smoothing": {"normalize": "numeric", "weighting": "place_value"}}},
    "ntil": {"terms": {"ntil": {"noise_scale": 0.0}}},
    "ntil_rescaled": {"terms": {"ntil": {"noise_scale": 0.0, "rescale_to_ce": True}}},
    "smmd": {"terms": {"smmd": {}}},
    "del": {"terms": {"del": {"weight": 1.0, "decimal_point_id": 0}}},
    "smmd_mmd_laplace": {"terms": {"smmd": {"mode": "mmd", "kernel": "laplace", "sigmas": [1.0, 4.0]}}},
    "smmd_smooth_fixed": {"terms": {"smmd": {"mode": "smooth", "alpha": 0.3, "squash_factor": None}}},
    "all": {"terms": {"ntl_was": {}, "ntl_mse": {}, "gce": {}, "dist2": {}, "smmd": {}}, "z_loss": 1e-4},
}


def shard_bounds(vocab_size: int, world: int) -> list[tuple[int, int]]:
    """Contiguous shards of ceil(V / world) columns, the last one shorter (Megatron's split)."""
    per = -(-vocab_size // world)
    return [(r * per, min((r + 1) * per, vocab_size)) for r in range(world)]


def make_labels(vocab: NumericVocab, generator: torch.Generator) -> torch.Tensor:
    """[3, 9] labels: numbers in runs, text tokens, ignored prompt positions, a sequence of text only."""
    ids = vocab.token_ids
    text = torch.tensor([t for t in range(V) if t not in set(ids.tolist())])
    labels = text[torch.randint(len(text), (3, 9), generator=generator)]
    pick = lambda n: ids[torch.randint(len(ids), (n,), generator=generator)]
    labels[0, :2] = -100
    labels[0, 2:5] = pick(3)  # a three-token number
    labels[0, 6:8] = pick(2)
    labels[1, 0:4] = -100
    labels[1, 5] = pick(1)[0]
    labels[1, 7:9] = pick(2)  # a number that runs to the end of the sequence
    return labels  # row 2: no numeric label at all


@contextlib.contextmanager
def forced_route(route: str | None):
    """Make every call take `route` ("sum" or "gather"; None: the cheaper one, as in production)."""
    if route is None:
        yield
        return
    original = numloss.parallel.choose_route
    force = lambda *args, **kwargs: route  # noqa: E731
    numloss.parallel.choose_route = numloss.logit_stats.choose_route = force
    try:
        yield
    finally:
        numloss.parallel.choose_route = numloss.logit_stats.choose_route = original


def _check_layouts(rank, world, dtype_name, route=None):
    with forced_route(route):
        _check_layouts_routed(rank, world, dtype_name)


def _check_layouts_routed(rank, world, dtype_name):
    dtype = getattr(torch, dtype_name)
    group = dist.group.WORLD
    start, end = shard_bounds(V, world)[rank]
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for vocab_name, (ids, values) in VOCABS.items():
        vocab = NumericVocab(ids, values, vocab_size=V)
        g = torch.Generator().manual_seed(1234)
        logits = (3 * torch.randn(3, 9, V, generator=g)).to(dtype)
        labels = make_labels(vocab, g)
        for case, config in CASES.items():
            if any(term_spec(name).vocab_problems(vocab, spec) for name, spec in config["terms"].items()):
                continue  # a term this vocabulary cannot serve (ntil, del on "first_half")
            objective = Objective(vocab, config)
            dense_in = logits.clone().requires_grad_(True)
            dense = objective(dense_in, labels)
            dense.loss.backward()
            local_in = logits[..., start:end].clone().requires_grad_(True)
            tp = objective(local_in, labels, group=group, vocab_start=start)
            tp.loss.backward()
            where = f"{vocab_name}/{case} TP={world} rank {rank} {dtype_name}"
            torch.testing.assert_close(tp.loss, dense.loss, **tol, msg=lambda m: f"{where} loss: {m}")
            for name in dense.terms:
                torch.testing.assert_close(tp.terms[name], dense.terms[name], **tol, msg=lambda m: f"{where} {name}: {m}")
            torch.testing.assert_close(local_in.grad, dense_in.grad[..., start:end], **tol,
                                       msg=lambda m: f"{where} grad: {m}")
            assert local_in.grad.dtype == dtype


@pytest.mark.parametrize("world,route", [(2, None), (2, "sum"), (4, "sum"), (4, "gather")])
def test_every_loss_matches_dense_fp32(world, route):
    run_ranks(world, _check_layouts, "float32", route)


def test_bf16_logits_match_dense():
    run_ranks(2, _check_layouts, "bfloat16")


def _layout(owned_counts: list[int]) -> ShardLayout:
    """A layout of TP = len(owned_counts) ranks, rank r owning owned_counts[r] numeric columns."""
    world = len(owned_counts)
    width = max(owned_counts)
    owner = torch.repeat_interleave(torch.arange(world), torch.tensor(owned_counts))
    slot = torch.cat([torch.arange(c) for c in owned_counts])
    return ShardLayout(owned=torch.arange(owned_counts[0]), local_cols=torch.arange(owned_counts[0]), width=width,
                       slot_of_column=owner * width + slot, vocab_size=128256, world=world)


def test_route_is_the_one_with_fewer_bytes_on_the_wire():
    # TP 8, Llama-3-8B shapes: 8192 tokens, 20% numeric, N = 1000.
    tokens, rows = 8192, 1638
    # All 1000 columns on rank 0: the SUM moves 2·7/8·(2T + M·N) floats, a gather 7·(T + M·1000).
    assert choose_route(tokens, rows, _layout([1000] + [0] * 7)) == "sum"
    # Spread evenly (width 125): 7·(T + M·125) < 1.75·(2T + M·1000).
    assert choose_route(tokens, rows, _layout([125] * 8)) == "gather"
    # Plain CE at TP 8: (sum-exp, target) in a SUM beats the local lse in a gather; at TP 2 the gather's
    # one float per row beats the SUM's two (a ring all-reduce and all-gather cost the same at p = 2).
    assert choose_route(tokens, 0, _layout([1000] + [0] * 7)) == "sum"
    assert choose_route(tokens, 0, _layout([1000, 0])) == "gather"
    # A numeric-only term sends just the block: rank 0 owning all → SUM; spread → gather.
    assert choose_route(tokens, rows, _layout([1000] + [0] * 7), lse=False) == "sum"
    assert choose_route(tokens, rows, _layout([125] * 8), lse=False) == "gather"


def _check_single_rank_group(rank, world):
    # A TP group of one rank is the dense path (no collective issued).
    vocab = NumericVocab(*VOCABS["spread"], vocab_size=V)
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(3, 9, V, generator=g), make_labels(vocab, g)
    with count_comm() as comm:
        out = functional.smmd(logits, labels, vocab, group=dist.new_group([0]) if rank == 0 else None)
    assert comm.calls == 0
    torch.testing.assert_close(out, functional.smmd(logits, labels, vocab), rtol=0, atol=0)


def test_tp1_group_is_dense():
    run_ranks(1, _check_single_rank_group)


def _check_comm(rank, world):
    group = dist.group.WORLD
    start, end = shard_bounds(V, world)[rank]
    vocab = NumericVocab(*VOCABS["rank0"], vocab_size=V)
    g = torch.Generator().manual_seed(7)
    logits, labels = torch.randn(3, 9, V, generator=g), make_labels(vocab, g)
    hidden, weight = torch.randn(3, 9, 16, generator=g), torch.randn(V, 16, generator=g) / 4
    tokens, numeric_rows = labels.numel(), int((vocab.index_of[labels.clamp_min(0)] >= 0)[labels >= 0].sum())
    local = logits[..., start:end].clone().requires_grad_(True)
    objective = Objective(vocab, CASES["all"])
    objective(local, labels, group=group, vocab_start=start)  # first call: the one-time layout exchange
    n, width = 10, 10  # all ten numeric columns live on rank 0: the common padded width is 10
    expected = {  # route -> (ops, bytes) of one step, forward; backward sends nothing
        "sum": (["all_reduce_max", "all_reduce_sum"], [4 * tokens, 4 * (2 * tokens + numeric_rows * n)]),
        "gather": (["all_reduce_max", "all_gather"], [4 * tokens, 4 * (tokens + numeric_rows * width)]),
    }
    layout = vocab.memo(("layout", id(group), world, rank, start, end - start), lambda: None)
    assert choose_route(tokens, numeric_rows, layout) == "gather"  # at TP 2 the gather is cheaper here
    for route in (None, "sum", "gather"):
        with forced_route(route):
            with count_comm() as forward:
                out = objective(local, labels, group=group, vocab_start=start)
            with count_comm() as backward:
                out.loss.backward()
            ops, nbytes = expected[route or "gather"]
            assert forward.ops() == ops and [r.bytes for r in forward.records] == nbytes, (route, forward.records)
            assert backward.calls == 0

            with count_comm() as ce_only:
                Objective(vocab, CASES["ce"])(local, labels, group=group, vocab_start=start)
            ce_ops, ce_bytes = {"sum": (["all_reduce_max", "all_reduce_sum"], [4 * tokens, 8 * tokens]),
                                "gather": (["all_reduce_max", "all_gather"], [4 * tokens, 4 * tokens])}[route or "gather"]
            assert ce_only.ops() == ce_ops and [r.bytes for r in ce_only.records] == ce_bytes

            no_numbers = torch.where(vocab.index_of[labels.clamp_min(0)] >= 0, 0, labels)  # 0 is not numeric here
            with count_comm() as none:
                out = objective(local, no_numbers, group=group, vocab_start=start)
                out.loss.backward()
            assert none.ops() == ce_ops  # no numeric row anywhere: the same two collectives as CE alone
            assert torch.isfinite(local.grad).all()

            # The chunked head: the same two collectives, once per step however many vocab chunks its shard
            # is cut into; backward sends only d hidden (the column-parallel input's gradient, [T, H] fp32).
            for chunk_size in (1, 1000):  # 1 column per chunk (18 or 19 chunks); ceil(V_local / 8) columns
                h, w = hidden.clone().requires_grad_(True), weight[start:end].clone().requires_grad_(True)
                with count_comm() as forward:
                    out = objective.from_hidden(h, w, labels, group=group, vocab_start=start, chunk_size=chunk_size)
                with count_comm() as backward:
                    out.loss.backward()
                assert forward.ops() == ops and [r.bytes for r in forward.records] == nbytes, (route, forward.records)
                assert backward.ops() == ["all_reduce_sum"] and backward.bytes == 4 * h.numel(), backward.records


def test_collectives_counted_exactly():
    run_ranks(2, _check_comm)


def _check_bad_layout(rank, world):
    vocab = NumericVocab(*VOCABS["spread"], vocab_size=V)
    logits = torch.randn(2, 4, 10)
    labels = torch.zeros(2, 4, dtype=torch.long)
    # Both ranks claim [0, 10): ids 12..36 are nobody's, and the ranges overlap.
    with pytest.raises(ValueError, match="overlaps|lies in no TP rank"):
        functional.smmd(logits, labels, vocab, group=dist.group.WORLD, vocab_start=0)


def test_shards_that_do_not_cover_the_vocab_are_an_error():
    run_ranks(2, _check_bad_layout)


PLAIN_IDS = list(range(3, 13))  # ten digit tokens, all in rank 0's slice [0, 19) of V = 37 at TP 2


def _check_plain_vocab(rank, world):
    """NumericVocab(ids, values) without vocab_size: under TP the shards tell the global width (37)."""
    group = dist.group.WORLD
    start, end = shard_bounds(V, world)[rank]
    plain = NumericVocab(PLAIN_IDS, list(range(10)))  # vocab_size defaults to 13: below the logits' 37
    sized = NumericVocab(PLAIN_IDS, list(range(10)), vocab_size=V)
    g = torch.Generator().manual_seed(3)
    logits, labels = 3 * torch.randn(3, 9, V, generator=g), make_labels(sized, g)
    labels[2, 0] = V - 1  # a label beyond the plain vocabulary's own table, owned by the last rank
    for config in (CASES["all"], CASES["ntil"]):
        dense_in = logits.clone().requires_grad_(True)
        dense = Objective(plain, config)(dense_in, labels)  # dense: any width above its largest id
        dense.loss.backward()
        reference = Objective(sized, config)(logits, labels)
        torch.testing.assert_close(dense.loss, reference.loss, rtol=0, atol=0)
        local_in = logits[..., start:end].clone().requires_grad_(True)
        tp = Objective(plain, config)(local_in, labels, group=group, vocab_start=start)
        tp.loss.backward()
        torch.testing.assert_close(tp.loss, dense.loss, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(local_in.grad, dense_in.grad[..., start:end], rtol=1e-6, atol=1e-6)
    # a label outside the shards' [0, 37) is still bad input
    with pytest.raises(ValueError, match=r"outside \[0, 37\)"):
        functional.smmd(logits[..., start:end], torch.full((3, 9), V), plain, group=group, vocab_start=start)
    # an explicit vocab_size that the shards contradict is refused, naming both widths
    wrong = NumericVocab(PLAIN_IDS, list(range(10)), vocab_size=30)
    with pytest.raises(ValueError, match=r"built for vocab_size=30.*tile \[0, 37\)"):
        functional.smmd(logits[..., start:end], labels, wrong, group=group, vocab_start=start)


def test_plain_vocab_takes_the_global_width_from_the_shards():
    run_ranks(2, _check_plain_vocab)


def _check_gap(rank, world):
    vocab = NumericVocab(PLAIN_IDS, list(range(10)))
    start, width = [(0, 18), (20, 17)][rank]  # ids 18 and 19 belong to no rank
    logits, labels = torch.randn(2, 4, width), torch.full((2, 4), 3)
    with pytest.raises(ValueError, match=r"leaves a gap before it.*must tile"):
        functional.smmd(logits, labels, vocab, group=dist.group.WORLD, vocab_start=start)


def test_shards_with_a_gap_are_an_error():
    run_ranks(2, _check_gap)


STANDALONE = [("ntl_was", {}), ("smmd", {}), ("dist2", {"normalize": "numeric", "weighting": "place_value"}),
              ("ntil", {"noise_scale": 0.0})]


def _check_standalone(rank, world):
    """A numeric-only term on a vocab shard, alone and next to another consumer of the same logits:
    equal to the dense call, one collective (the numeric block), none in backward."""
    group = dist.group.WORLD
    start, end = shard_bounds(V, world)[rank]
    for vocab_name in ("spread", "rank0"):
        vocab = NumericVocab(*VOCABS[vocab_name], vocab_size=V)
        g = torch.Generator().manual_seed(11)
        logits, labels = 3 * torch.randn(3, 9, V, generator=g), make_labels(vocab, g)
        functional.smmd(logits[..., start:end], labels, vocab, group=group, vocab_start=start)  # layout exchange
        for route in (None, "sum", "gather"):
            for name, options in STANDALONE:
                term = getattr(functional, name)
                other = lambda x: 1e-3 * (x.float() ** 2).sum()  # noqa: E731  another consumer: a dense gradient
                for with_other in (False, True):
                    dense_in = logits.clone().requires_grad_(True)
                    dense = term(dense_in, labels, vocab, **options)
                    (dense + (other(dense_in) if with_other else 0)).backward()
                    local_in = logits[..., start:end].clone().requires_grad_(True)
                    with forced_route(route), count_comm() as forward:
                        tp = term(local_in, labels, vocab, group=group, vocab_start=start, **options)
                    with count_comm() as backward:
                        (tp + (other(local_in) if with_other else 0)).backward()
                    where = f"{vocab_name}/{name}/{route}/{with_other} rank {rank}"
                    assert forward.calls == 1 and backward.calls == 0, (where, forward.ops(), backward.ops())
                    torch.testing.assert_close(tp, dense, rtol=1e-6, atol=1e-6, msg=lambda m: f"{where}: {m}")
                    torch.testing.assert_close(local_in.grad, dense_in.grad[..., start:end], rtol=1e-6, atol=1e-6,
                                               msg=lambda m: f"{where} grad: {m}")


def test_standalone_numeric_terms_on_shards():
    run_ranks(2, _check_standalone)


DEL_POINT = 0  # a text token in both digit vocabularies


def _number_labels(vocab: NumericVocab, rows: list[str]) -> torch.Tensor:
    """Labels from strings: digit d -> the vocabulary's token of value d, '.' -> DEL_POINT, '_' ignored, any
    other character a text token."""
    token_of = {int(v): int(t) for t, v in zip(vocab.token_ids, vocab.values)}
    text = [t for t in range(V) if t not in token_of.values() and t != DEL_POINT]
    def label(c, i):
        return token_of[int(c)] if c.isdigit() else DEL_POINT if c == "." else -100 if c == "_" else text[i % len(text)]
    return torch.tensor([[label(c, i) for i, c in enumerate(r)] for r in rows])


def _check_del(rank, world):
    """DEL on TP shards equals dense, by both routes: value, term and gradient; the same two collectives
    (and bytes) as any other numeric term, none in backward; standalone: the numeric block's one."""
    group = dist.group.WORLD
    start, end = shard_bounds(V, world)[rank]
    rows = ["__12.55 is 7", "x.5 3.14. 1x", "_407_ 2.0.1x", "no numbers.x", "99.9_9 and 5"]
    digits = sum(c.isdigit() for r in rows for c in r)  # 21
    for vocab_name in ("spread", "rank0"):
        vocab = NumericVocab(*VOCABS[vocab_name], vocab_size=V, decimal_point_id=DEL_POINT)
        labels = _number_labels(vocab, rows)
        g = torch.Generator().manual_seed(21)
        logits = 3 * torch.randn(*labels.shape, V, generator=g)
        smmd = Objective(vocab, {"terms": {"smmd": {}}})
        smmd(logits[..., start:end], labels, group=group, vocab_start=start)  # the one-time layout exchange
        for route in (None, "sum", "gather"):
            for config in ({"del": {}}, {"del": 1.0, "smmd": {}, "gce": 0.5}):
                objective = Objective(vocab, {"terms": config})
                dense_in = logits.clone().requires_grad_(True)
                dense = objective(dense_in, labels)
                dense.loss.backward()
                local_in = logits[..., start:end].clone().requires_grad_(True)
                with forced_route(route), count_comm() as forward:
                    tp = objective(local_in, labels, group=group, vocab_start=start)
                with count_comm() as backward:
                    tp.loss.backward()
                with forced_route(route), count_comm() as other:
                    smmd(local_in.detach(), labels, group=group, vocab_start=start)
                where = f"{vocab_name}/{route}/{sorted(config)} TP={world} rank {rank}"
                assert dense.numeric_positions == digits and dense.terms["del"] > 0
                torch.testing.assert_close(tp.loss, dense.loss, rtol=1e-6, atol=1e-6, msg=lambda m: f"{where} loss: {m}")
                torch.testing.assert_close(tp.terms["del"], dense.terms["del"], rtol=1e-6, atol=1e-6,
                                           msg=lambda m: f"{where} del: {m}")
                torch.testing.assert_close(local_in.grad, dense_in.grad[..., start:end], rtol=1e-6, atol=1e-6,
                                           msg=lambda m: f"{where} grad: {m}")
                assert forward.calls == 2 and backward.calls == 0, (where, forward.ops(), backward.ops())
                assert [(r.op, r.bytes) for r in forward.records] == [(r.op, r.bytes) for r in other.records], where
            dense_in = logits.clone().requires_grad_(True)
            dense = functional.digit_entropy(dense_in, labels, vocab)
            dense.backward()
            local_in = logits[..., start:end].clone().requires_grad_(True)
            with forced_route(route), count_comm() as forward:
                tp = functional.digit_entropy(local_in, labels, vocab, group=group, vocab_start=start)
            tp.backward()
            with forced_route(route), count_comm() as block_only:
                functional.smmd(local_in.detach(), labels, vocab, group=group, vocab_start=start)
            # one collective, the [M, 10] digit block's (as any term read from the numeric block alone)
            assert forward.calls == 1 and forward.records == block_only.records, (forward.records, block_only.records)
            torch.testing.assert_close(tp, dense, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(local_in.grad, dense_in.grad[..., start:end], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("world", [2, 3])
def test_digit_entropy_on_shards_matches_dense(world):
    run_ranks(world, _check_del)
