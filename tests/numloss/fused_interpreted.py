"""The fused pass's Triton kernels (`numloss.fused_pass`) against the eager reference, on CPU under
Triton's interpreter. Not collected by the suite on its own (no `test_` prefix): TRITON_INTERPRET=1 must
be set before triton is first imported in the process, and other test files import triton through
megatron-core, so `test_fused_pass.py` runs this file in a fresh pytest process with that variable set.

Every comparison is fused vs eager on the same inputs: the loss, CE and every term's value (rel 1e-5), and
the gradient (fp32: rel 1e-5; bf16: each entry rounded once from fp32 values that agree to ~1e-6, so
within one bf16 step of the eager entry).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from numloss import NumericVocab, Objective
from numloss import fused_pass
from numloss.losses import TERMS, term_spec
from tests.distributed import run_ranks

pytestmark = pytest.mark.skipif(not fused_pass.interpreting(), reason="needs TRITON_INTERPRET=1 before triton imports")

IGNORE = -100
POINT = 5  # the decimal point's token (DEL's runs of digits and points)


def batch(n_numeric: int, vocab_size: int, dtype: torch.dtype, rows: int = 3, seq: int = 10, seed: int = 0):
    """(vocab, logits [rows, seq, V], labels): numeric ids 7 .. 7 + N (values 0 .. N-1, digits when N = 10),
    about a third of the labels numeric, a few ignored, two decimal points, and the last row without any
    numeric label."""
    g = torch.Generator().manual_seed(seed)
    vocab = NumericVocab(torch.arange(7, 7 + n_numeric), torch.arange(n_numeric), vocab_size=vocab_size,
                         decimal_point_id=POINT)
    labels = torch.randint(7 + n_numeric, vocab_size, (rows, seq), generator=g)
    numeric = torch.rand(rows, seq, generator=g) < 0.35
    numeric[-1] = False
    labels[numeric] = torch.randint(7, 7 + n_numeric, (int(numeric.sum()),), generator=g)
    labels[0, :2] = IGNORE
    labels[1, -1] = IGNORE
    labels[0, 4] = labels[1, 3] = POINT
    logits = (3 * torch.randn(rows, seq, vocab_size, generator=g)).to(dtype)
    return vocab, logits, labels


def forward_backward(objective: Objective, logits: torch.Tensor, labels: torch.Tensor, **kwargs):
    torch.manual_seed(1234)  # NTIL draws Gumbel noise: both paths see the same
    x = logits.clone().requires_grad_(True)
    out = objective(x, labels, **kwargs)
    out.loss.backward()
    return out, x.grad


def assert_gradients_close(fused: torch.Tensor, eager: torch.Tensor) -> None:
    assert fused.dtype == eager.dtype and fused.shape == eager.shape
    if eager.dtype == torch.float32:
        torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-9)
    else:  # one rounding each from fp32 values that agree to ~1e-6: at most one bf16 step apart
        step = eager.float().abs().clamp(min=1e-30) * 2.0 ** -7
        assert ((fused.float() - eager.float()).abs() <= step).all()


def term_cases():
    for n, v in ((10, 200), (1000, 1100)):
        vocab = batch(n, v, torch.float32)[0]
        for name in [None, *TERMS]:
            if name is not None and term_spec(name).vocab_problems(vocab):
                continue  # NTIL and DEL need digits
            yield n, v, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,v,term", list(term_cases()), ids=lambda x: str(x))
def test_fused_equals_eager_for_every_term(n, v, term, dtype):
    vocab, logits, labels = batch(n, v, dtype)
    config = {"terms": {} if term is None else {term: {}}}
    eager, eager_grad = forward_backward(Objective(vocab, config, fused=False), logits, labels)
    fused, fused_grad = forward_backward(Objective(vocab, config, fused=True), logits, labels)
    assert term is None or eager.numeric_positions > 0
    torch.testing.assert_close(fused.loss, eager.loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(fused.ce, eager.ce, rtol=1e-5, atol=1e-7)
    for name, value in eager.terms.items():
        torch.testing.assert_close(fused.terms[name], value, rtol=1e-5, atol=1e-7)
    assert_gradients_close(fused_grad, eager_grad)
    # the eager gradient is not trivially matched: it is nonzero off the targets and at the numeric block
    assert eager_grad.float().abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gradient_in_place_aliases_the_logits_and_equals_eager(dtype):
    vocab, logits, labels = batch(10, 200, dtype)
    config = {"terms": {"smmd": {}, "ntl_was": {}}}
    _, eager_grad = forward_backward(Objective(vocab, config, fused=False), logits, labels)
    x = logits.clone().requires_grad_(True)
    seen = []
    x.register_hook(lambda g: seen.append(g))  # the gradient autograd hands to x, before accumulation
    version = x._version
    Objective(vocab, config, fused=True)(x, labels, grad_in_place=True).loss.backward()
    (grad,) = seen
    assert grad.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()  # no second [T, V] buffer
    assert x._version > version  # the logits now hold their gradient, and autograd knows
    assert_gradients_close(grad, eager_grad)


def test_gradient_in_place_fails_loudly_when_the_logits_are_read_again_in_backward():
    vocab, logits, labels = batch(10, 200, torch.float32)
    x = logits.clone().requires_grad_(True)
    penalty = x.pow(2).sum()  # saves x; its backward runs after the objective's (created earlier)
    out = Objective(vocab, {"terms": {"smmd": {}}}, fused=True)(x, labels, grad_in_place=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (out.loss + 1e-3 * penalty).backward()
    # without grad_in_place the same graph is fine
    y = logits.clone().requires_grad_(True)
    (Objective(vocab, {"terms": {"smmd": {}}}, fused=True)(y, labels).loss + 1e-3 * y.pow(2).sum()).backward()


def test_strided_logits_slice_equals_eager():
    """`logits[:, :-1]` (the usual shift) is not contiguous: the kernels read rows with a stride."""
    vocab, logits, labels = batch(10, 200, torch.float32, seq=11)
    config = {"terms": {"dist2": {}}}
    results = []
    for fused in (False, True):
        x = logits.clone().requires_grad_(True)
        Objective(vocab, config, fused=fused)(x[:, :-1], labels[:, 1:]).loss.backward()
        results.append(x.grad)
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-9)


def test_strided_targets_are_read_at_their_own_positions():
    """The row kernel reads the targets and their ownership as flat arrays: a strided view of them (every
    other label) must give each row its own target logit, as a gather from the logits does."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 40, generator=g)
    labels = torch.randint(0, 40, (12,), generator=g)
    owns = torch.rand(12, generator=g) < 0.7
    target, owned = labels[::2], owns[::2]
    assert not target.is_contiguous() and not owned.is_contiguous()
    row_max, sum_exp, picked = fused_pass.row_stats(x, target, owned)
    torch.testing.assert_close(row_max, x.max(1).values)
    torch.testing.assert_close(sum_exp, (x - x.max(1, keepdim=True).values).exp().sum(1))
    expected = x.gather(1, target[:, None]).squeeze(1)
    torch.testing.assert_close(picked[owned], expected[owned])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunked_head_fused_equals_eager(dtype):
    vocab, _, labels = batch(10, 200, dtype)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(*labels.shape, 16, generator=g).to(dtype)
    weight = (torch.randn(200, 16, generator=g) / 2).to(dtype)
    config = {"terms": {"smmd": {}, "gce": {}}}
    results = []
    for fused in (False, True):
        torch.manual_seed(1234)
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = Objective(vocab, config, fused=fused).from_hidden(h, w, labels, chunk_size=8)  # several chunks
        out.loss.backward()
        results.append((out.loss.detach(), h.grad, w.grad))
    (loss_e, h_e, w_e), (loss_f, h_f, w_f) = results
    torch.testing.assert_close(loss_f, loss_e, rtol=1e-5, atol=1e-7)
    # the GEMMs of a bf16 head see chunk gradients one bf16 step apart at most
    tol = {"rtol": 1e-5, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 1e-3}
    torch.testing.assert_close(h_f.float(), h_e.float(), **tol)
    torch.testing.assert_close(w_f.float(), w_e.float(), **tol)


def _vocab_parallel_rank(rank: int, world: int, n: int, v: int, terms: dict):
    vocab, logits, labels = batch(n, v, torch.float32, seed=3)
    dense, dense_grad = forward_backward(Objective(vocab, {"terms": terms}, fused=False), logits, labels)
    width = v // world
    local = logits[..., rank * width:(rank + 1) * width].contiguous()
    out, grad = forward_backward(Objective(vocab, {"terms": terms}, fused=True), local, labels,
                                 group=dist.group.WORLD, vocab_start=rank * width)
    torch.testing.assert_close(out.loss, dense.loss, rtol=1e-5, atol=1e-7)
    for name, value in dense.terms.items():
        torch.testing.assert_close(out.terms[name], value, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad, dense_grad[..., rank * width:(rank + 1) * width], rtol=1e-5, atol=1e-9)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n,v", [(10, 200), (1000, 1100)])
def test_vocab_parallel_fused_equals_dense_eager_on_two_gloo_ranks(n, v):
    terms = {"smmd": {}, "ntl_was": {}, **({"ntil": {}, "del": {}} if n == 10 else {})}
    run_ranks(2, _vocab_parallel_rank, n, v, terms, timeout=240.0)
