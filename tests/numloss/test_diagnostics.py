"""Per-term gradient diagnostics (`numloss.diagnostics`) against a dense float64 autograd reference.

The reference is written from the logits with the independent loss implementations of
`numeric_reference`: each weighted part of the total (CE, or (1 - w)·CE beside GCE; w·term; the
z-loss) is differentiated with respect to the whole [B, S, V] logits, and the gradient is cut to the
numeric positions x numeric columns. Its norms, shares and cosines with CE's gradient must equal what
the objective reports, at TP 1 and TP 2 (gloo, 2 processes), from logits and from hidden states (the
chunked head), for CE + SMMD + NTL-WAS + DIST2 + GCE (+ z-loss), for the full-vocabulary options, and
for plain CE (whose pass reads the numeric block only for the diagnostics). Also: a weight-0 term's norm
is 0; turning diagnostics on changes neither the loss nor any gradient (to the bit, NTIL's random noise
included); the Megatron loss_func reports exactly the keys its step broadcasts. The loop's side (which
steps, the data-parallel sums finished into a row): tests/recipes/training/test_diagnostics.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from numloss import NumericVocab, Objective, ObjectiveConfig
from numloss.diagnostics import finalize, sum_keys
from tests.distributed import run_ranks
from tests.numloss import numeric_reference as R
from tests.numloss.test_parallel import VOCABS, V, make_labels, shard_bounds

H = 16
REFERENCE_TERMS = {"smmd": R.smmd, "ntl_was": R.ntl_was, "dist2": R.dist2, "gce": R.gce}
CONFIGS = {
    "mixed": {"terms": {"smmd": {}, "ntl_was": {}, "dist2": {}, "gce": {"weight": 0.5}}, "z_loss": 1e-3},
    "full_vocab": {"terms": {"gce": {"sigma": 2.0}, "ntl_was": {"reweigh": True, "squash_factor": 3.0},
                             "dist2": {"normalize": "numeric", "tau": 2.0}, "smmd": {"weight": 1.0}}},
    "ce": {"terms": {}},
}


def inputs(vocab_name: str, rows: int = 3, seed: int = 7):
    """(vocab, hidden [rows, 9, H], lm_head weight [V, H], labels [rows, 9]): logits = hidden @ weightᵀ."""
    ids, values = VOCABS[vocab_name]
    vocab = NumericVocab(ids, values, vocab_size=V)
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, 9, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.8
    labels = torch.cat([make_labels(vocab, g) for _ in range(-(-rows // 3))])[:rows]
    return vocab, hidden, weight, labels


def reference(logits: torch.Tensor, labels: torch.Tensor, vocab_name: str | tuple[list, list], config: dict,
              exact_off: dict | None = None) -> dict:
    """The logged diagnostics of `config` on `logits`, from float64 autograd through `numeric_reference`;
    `vocab_name` names one of VOCABS or is (ids, values) itself. `exact_off` receives each part's exact
    norm off the block (what `off_block_max` bounds)."""
    ids, values = VOCABS[vocab_name] if isinstance(vocab_name, str) else vocab_name
    V = logits.shape[-1]
    terms = ObjectiveConfig.from_dict(dict(config)).terms  # resolves the default weights only
    x = logits.double().detach().requires_grad_(True)
    ce = R.ce(x, labels)
    gce = terms.get("gce")
    parts = {"ce": ce if gce is None else (1 - gce.weight) * ce}
    for name, term in terms.items():
        parts[name] = term.weight * REFERENCE_TERMS[name](x, labels, ids, values, **term.options)
    if config.get("z_loss"):
        parts["z_loss"] = R.ce(x, labels, z_loss=config["z_loss"]) - ce
    numeric = set(ids)
    rows = [i for i, y in enumerate(labels.reshape(-1).tolist()) if y in numeric]
    others = [j for j in range(V) if j not in numeric]

    def numeric_rows(value):
        """d value / d logits at the numeric positions, every column: [M, V]."""
        grad = torch.autograd.grad(value, x, retain_graph=True, allow_unused=True)[0]
        return torch.zeros(len(rows), V, dtype=torch.float64) if grad is None else grad.reshape(-1, V)[rows]

    def block(value):
        return numeric_rows(value)[:, ids]

    direction = block(ce)
    full = {name: numeric_rows(value) for name, value in parts.items()}
    blocks = {name: g[:, ids] for name, g in full.items()}
    norms = {name: float(b.norm()) for name, b in blocks.items()}
    total = sum(norms.values())
    out = {}
    for name, b in blocks.items():
        out[f"grad/{name}/norm"] = norms[name]
        out[f"grad/{name}/share"] = norms[name] / total if total else None
        # off the block, row i's gradient is g_i · p_ij: the bound |g_i| · Σ_j p_ij is |Σ_j grad_ij|
        off_block = full[name][:, others]
        out[f"grad/{name}/off_block_max"] = float(off_block.sum(dim=-1).norm())
        assert float(off_block.norm()) <= out[f"grad/{name}/off_block_max"] * (1 + 1e-12) + 1e-15  # it bounds
        if exact_off is not None:
            exact_off[name] = float(off_block.norm())
        if name != "ce":
            scale = norms[name] * float(direction.norm())
            out[f"grad/{name}/cos_ce"] = float((b * direction).sum()) / scale if scale else None
    return out


def assert_matches(got: dict, want: dict, where: str) -> None:
    got = {k: v for k, v in got.items() if k.startswith("grad/")}
    assert set(got) == set(want), f"{where}: keys {sorted(got)} != {sorted(want)}"
    for key, value in want.items():
        if value is None:
            assert got[key] is None, f"{where} {key}: {got[key]} is not None"
        else:
            assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-7), f"{where} {key}: {got[key]} != {value}"


def diagnostics_of(out) -> dict:
    return finalize(out.log_dict())


# ---- TP 1 -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("vocab_name", ["spread", "first_half"])
def test_dense_and_chunked_match_the_reference(vocab_name, config):
    vocab, hidden, weight, labels = inputs(vocab_name)
    logits = hidden @ weight.t()
    want = reference(logits, labels, vocab_name, CONFIGS[config])
    objective = Objective(vocab, CONFIGS[config], diagnostics=True)
    assert_matches(diagnostics_of(objective(logits, labels)), want, f"{vocab_name}/{config} logits")
    chunked = objective.from_hidden(hidden, weight, labels, chunk_size=4)
    assert_matches(diagnostics_of(chunked), want, f"{vocab_name}/{config} chunked")


def test_a_term_with_weight_zero_has_norm_zero():
    vocab, hidden, weight, labels = inputs("spread")
    out = Objective(vocab, {"terms": {"smmd": 0.0, "ntl_was": {}, "gce": 0.0}}, diagnostics=True)(hidden @ weight.t(), labels)
    got = diagnostics_of(out)
    for name in ("smmd", "gce"):
        assert got[f"grad/{name}/norm"] == 0.0 and got[f"grad/{name}/share"] == 0.0
        assert got[f"grad/{name}/cos_ce"] is None  # no direction: undefined, not 0
    assert got["grad/ntl_was/norm"] > 0 and got["grad/ce/norm"] > 0
    assert got["grad/ce/share"] + got["grad/ntl_was/share"] == pytest.approx(1.0)


def test_switches_and_keys():
    vocab, hidden, weight, labels = inputs("spread")
    logits = hidden @ weight.t()
    config = CONFIGS["mixed"]
    assert Objective(vocab, config)(logits, labels).grad_sums is None
    assert Objective(vocab, config, diagnostics=True)(logits, labels, diagnostics=False).grad_sums is None
    out = Objective(vocab, config)(logits, labels, diagnostics=True)
    objective = Objective(vocab, config)
    assert sorted(out.grad_sums) == sum_keys(objective)
    assert set(sum_keys(objective)) <= set(out.log_dict())


@pytest.mark.parametrize("head", ["logits", "chunked"])
@pytest.mark.parametrize("config", ["mixed", "ntil_noise", "ce"])
def test_diagnostics_change_neither_loss_nor_gradients(head, config):
    """Bit-identical with and without: loss, terms and every input's gradient; NTIL draws its Gumbel
    noise from torch's generator, which the diagnostics leave as they found it."""
    vocab, hidden, weight, labels = inputs("rank0")
    spec = {"terms": {"ntil": {}, "smmd": {}}} if config == "ntil_noise" else CONFIGS[config]
    results = []
    for diagnostics in (False, True):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        torch.manual_seed(3)
        objective = Objective(vocab, spec, diagnostics=diagnostics)
        out = objective(h @ w.t(), labels) if head == "logits" else objective.from_hidden(h, w, labels, chunk_size=4)
        out.loss.backward()
        results.append((out.loss, out.ce, out.terms, h.grad, w.grad, torch.rand(3)))
    (loss0, ce0, terms0, dh0, dw0, after0), (loss1, ce1, terms1, dh1, dw1, after1) = results
    assert torch.equal(loss0, loss1) and torch.equal(ce0, ce1)
    assert all(torch.equal(terms0[k], terms1[k]) for k in terms0)
    assert torch.equal(dh0, dh1) and torch.equal(dw0, dw1)
    assert torch.equal(after0, after1)  # the run's random stream goes on as without diagnostics


def test_megatron_loss_func_reports_the_broadcast_keys():
    """The last stage's report holds exactly the keys `recipes.engines.megatron.runtime.step.log_keys` makes
    every stage expect (a mismatch would break the pipeline broadcast)."""
    from numloss.adapters.megatron import numeric_loss_func

    vocab, hidden, weight, labels = inputs("spread")
    objective = Objective(vocab, CONFIGS["mixed"])
    counts = objective.counts(labels)
    _, _, report = numeric_loss_func(objective, counts, labels, hidden @ weight.t(), group=None, diagnostics=True)
    keys = ["loss", "ce", "numeric_positions", *(f"term/{k}" for k in objective.config.terms)]
    assert sorted(report) == sorted(keys + sum_keys(objective))
    assert_matches(finalize(report), reference(hidden @ weight.t(), labels, "spread", CONFIGS["mixed"]), "megatron")


# ---- TP 2, real gloo processes ------------------------------------------------------------------------


def _tensor_parallel(rank, world):
    group = dist.group.WORLD
    start, end = shard_bounds(V, world)[rank]
    for vocab_name in ("spread", "rank0", "first_half"):
        vocab, hidden, weight, labels = inputs(vocab_name)
        logits = hidden @ weight.t()
        for name, config in CONFIGS.items():
            want = reference(logits, labels, vocab_name, config)
            where = f"{vocab_name}/{name} TP {world} rank {rank}"
            objective = Objective(vocab, config, diagnostics=True)
            local = logits[..., start:end].clone().requires_grad_(True)
            out = objective(local, labels, group=group, vocab_start=start)
            assert_matches(diagnostics_of(out), want, where + " logits")
            out.loss.backward()
            plain = logits[..., start:end].clone().requires_grad_(True)
            off = Objective(vocab, config)(plain, labels, group=group, vocab_start=start)
            off.loss.backward()
            assert torch.equal(out.loss, off.loss) and torch.equal(local.grad, plain.grad), where
            chunked = objective.from_hidden(hidden, weight[start:end], labels, group=group, vocab_start=start,
                                            chunk_size=4)
            assert_matches(diagnostics_of(chunked), want, where + " chunked")


def test_tensor_parallel_matches_the_reference():
    run_ranks(2, _tensor_parallel)


# ---- a Llama-3-sized vocabulary ----------------------------------------------------------------------------

BIG_V, BIG_N = 128_256, 1000  # Llama-3's vocabulary and its 1000 number tokens "0".."999"
BIG_CONFIG = {"terms": {"dist2": {"weight": 0.3}, "gce": {"weight": 0.5}}}  # two full-vocabulary terms beside CE


def big_inputs(tail: str):
    """(ids, values, hidden [2, 9, H + 1], weight [V, H + 1], labels [2, 9]) at BIG_V. The last hidden
    feature is 1, so the weight's last column is a per-token bias. tail="spread": an untrained model,
    the ~99% of the mass off the numbers spread over 127k tokens; "sink": a trained one, ~95% on the
    numbers and nearly all the rest on one token (an end-of-text)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randperm(BIG_V, generator=g)[:BIG_N].sort().values.tolist()
    values = [float(v) for v in range(BIG_N)]
    hidden = torch.cat([torch.randn(2, 9, H, generator=g), torch.ones(2, 9, 1)], dim=-1)
    weight = torch.cat([torch.randn(BIG_V, H, generator=g) * 0.25, torch.zeros(BIG_V, 1)], dim=-1)
    if tail == "sink":
        weight[ids, -1] = 12.0
        weight[next(t for t in range(BIG_V) if t not in set(ids)), -1] = 16.0
    labels = torch.randint(BIG_V, (2, 9), generator=g)
    labels[:, 3:7] = torch.tensor(ids)[torch.randint(BIG_N, (2, 4), generator=g)]  # a 4-token number per row
    labels[0, :2] = -100
    return ids, values, hidden, weight, labels


def _big_tensor_parallel(rank, world, tail, want):
    ids, values, hidden, weight, labels = big_inputs(tail)
    vocab = NumericVocab(ids, values, vocab_size=BIG_V)
    start, end = shard_bounds(BIG_V, world)[rank]
    out = Objective(vocab, BIG_CONFIG, diagnostics=True).from_hidden(
        hidden, weight[start:end], labels, group=dist.group.WORLD, vocab_start=start, chunk_size=8)
    assert_matches(diagnostics_of(out), want, f"V {BIG_V} {tail} TP {world} rank {rank} chunked")


@pytest.mark.parametrize("tail", ["spread", "sink"])
def test_the_off_block_bound_at_a_llama3_vocabulary(tail):
    """At V = 128k and N = 1000 the numeric block is 0.8% of a row's columns. The diagnostics (norms,
    shares, cosines, bound) match the float64 reference, dense at TP 1 and chunked at TP 2. How close
    the bound is depends on where the mass off the numbers sits: on one token it is the exact norm to a
    few %; spread over 127k tokens it overstates it by up to sqrt(V - N) = 356 (the exact norm is
    m/sqrt(V - N) for a uniform spread; these logits: x216), which is why the regimes' table calls it a
    bound."""
    ids, values, hidden, weight, labels = big_inputs(tail)
    logits = hidden @ weight.t()
    exact: dict[str, float] = {}
    want = reference(logits, labels, (ids, values), BIG_CONFIG, exact_off=exact)
    vocab = NumericVocab(ids, values, vocab_size=BIG_V)
    assert_matches(diagnostics_of(Objective(vocab, BIG_CONFIG, diagnostics=True)(logits, labels)), want,
                   f"V {BIG_V} {tail} dense")
    run_ranks(2, _big_tensor_parallel, tail, want)
    for part in ("ce", "dist2", "gce"):
        bound, norm = want[f"grad/{part}/off_block_max"], exact[part]
        assert 0 < norm <= bound * (1 + 1e-12)
        if tail == "sink":
            assert bound <= 1.05 * norm, (part, bound / norm)
        else:
            assert bound >= 100 * norm, (part, bound / norm)
