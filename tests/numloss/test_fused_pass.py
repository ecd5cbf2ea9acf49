"""The fused pass over the logits (`numloss.fused_pass`): its dispatch here, the interpreter checks in a
process of their own, and on a GPU the kernels at Llama-3 sizes.

- `tests/numloss/fused_interpreted.py` (fused == eager for every term at N = 10 and 1000 with ignored
  labels, the gradient in place, a strided slice, the chunked head, vocab-parallel on 2 gloo ranks) runs in
  a fresh pytest process with TRITON_INTERPRET=1: the variable must be set before triton is first imported,
  and in this process megatron-core may already have imported it.
- `tests/numloss/fused_compiled.py` compiles both kernels ahead of time for sm_80 and sm_90 (triton's
  compiler and its ptxas need no GPU) as the JIT specialises them on a GPU: no register spills, and 128-bit
  global loads and stores of the logits when rows are aligned (the chunked head keeps them so).
- `-k cuda` (skipped without a GPU): the compiled kernels against the eager path on logits [2048, 128256]
  bf16, and the gradient in place allocating no second [T, V].
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from numloss import NumericVocab, Objective
from numloss import fused_pass

REPO = Path(__file__).resolve().parents[2]
triton_missing = not fused_pass.triton_imports()


@pytest.mark.timeout(600)
@pytest.mark.skipif(triton_missing, reason="triton does not import")
def test_fused_kernels_equal_eager_under_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("NUMLOSS_FUSED", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/numloss/fused_interpreted.py"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=540)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]


@pytest.mark.timeout(600)
@pytest.mark.skipif(triton_missing, reason="triton does not import")
def test_kernels_compile_for_sm80_and_sm90_without_spills_and_with_vector_loads(tmp_path):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "tests/numloss/fused_compiled.py", "--out", str(tmp_path / "r.json")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "r.json").read_text())
    assert {(r["kernel"], r["arch"], r["dtype"], r["aligned"]) for r in rows} == {
        (k, a, d, al) for k in ("row_stats_kernel", "gradient_kernel") for a in (80, 90) for d in ("bf16", "fp32")
        for al in (True, False)}
    for row in rows:
        where = f"{row['kernel']} sm_{row['arch']} {row['dtype']} aligned={row['aligned']}"
        assert row["target"] == ("sm_90a" if row["arch"] == 90 else "sm_80"), where
        assert row["spill_bytes"] == 0, f"{where}: {row['spill_bytes']} bytes of register spills"
        assert 0 < row["registers"] <= 64, f"{where}: {row['registers']} registers"
        if row["aligned"]:  # 16-byte loads of the logits (and stores of the gradient): 8 bf16 or 4 fp32 a load
            assert "ld.global.v4.b32" in row["loads"], f"{where}: loads {row['loads']}"
            if row["kernel"] == "gradient_kernel":
                assert "st.global.v4.b32" in row["stores"], f"{where}: stores {row['stores']}"
    # an unaligned width (a chunk whose width is not a multiple of 16) leaves the logits' loads scalar: why the
    # chunked head rounds its chunk width
    unaligned = [r for r in rows if not r["aligned"] and r["dtype"] == "bf16"]
    assert unaligned and all("ld.global.v4.b32" not in r["loads"] for r in unaligned), unaligned


def test_cpu_tensors_take_the_eager_path_unless_asked(monkeypatch):
    x = torch.zeros(2, 3)
    monkeypatch.delenv("NUMLOSS_FUSED", raising=False)
    assert not fused_pass.use_fused(x)
    monkeypatch.setenv("NUMLOSS_FUSED", "0")
    assert not fused_pass.use_fused(x) and not fused_pass.use_fused(x, fused=False)
    monkeypatch.setenv("NUMLOSS_FUSED", "yes")
    with pytest.raises(ValueError, match="NUMLOSS_FUSED='yes'"):
        fused_pass.use_fused(x)


@pytest.mark.skipif(triton_missing, reason="triton does not import")
def test_fused_on_cpu_without_the_interpreter_is_a_clear_error(monkeypatch):
    if fused_pass.interpreting():
        pytest.skip("this process runs triton's interpreter")
    monkeypatch.delenv("NUMLOSS_FUSED", raising=False)
    vocab = NumericVocab(torch.arange(3, 13), torch.arange(10), vocab_size=40)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        Objective(vocab, fused=True)(torch.randn(2, 5, 40), torch.randint(0, 40, (2, 5)))


# ---- on a GPU ----------------------------------------------------------------------------------------


def _llama3_batch(n_numeric: int, tokens: int = 2048, vocab_size: int = 128256):
    g = torch.Generator().manual_seed(0)
    vocab = NumericVocab(torch.arange(100, 100 + n_numeric), torch.arange(n_numeric), vocab_size=vocab_size)
    labels = torch.randint(100 + n_numeric, vocab_size, (tokens,), generator=g)
    numeric = torch.rand(tokens, generator=g) < 0.25
    labels[numeric] = torch.randint(100, 100 + n_numeric, (int(numeric.sum()),), generator=g)
    labels[:7] = -100
    logits = (2 * torch.randn(tokens, vocab_size, generator=g)).to("cuda", torch.bfloat16)
    return vocab, logits, labels.cuda()


@pytest.mark.skipif(not torch.cuda.is_available() or triton_missing, reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("n,term", [(10, None), (10, "smmd"), (10, "ntil"), (1000, "smmd"), (1000, "gce")])
def test_cuda_fused_equals_eager_at_llama3_sizes(n, term):
    vocab, logits, labels = _llama3_batch(n)
    config = {"terms": {} if term is None else {term: {}}}
    results = []
    for fused in (False, True):
        torch.manual_seed(0)
        x = logits.clone().requires_grad_(True)
        out = Objective(vocab, config, fused=fused)(x, labels)
        out.loss.backward()
        results.append((out.loss.detach(), x.grad))
    (loss_e, grad_e), (loss_f, grad_f) = results
    torch.testing.assert_close(loss_f, loss_e, rtol=1e-5, atol=1e-6)
    step = grad_e.float().abs().clamp(min=1e-30) * 2.0 ** -7  # one bf16 step from the same fp32 value
    assert ((grad_f.float() - grad_e.float()).abs() <= step).all()


@pytest.mark.skipif(not torch.cuda.is_available() or triton_missing, reason="needs a CUDA GPU and triton")
def test_cuda_gradient_in_place_allocates_no_second_logits():
    vocab, logits, labels = _llama3_batch(10)
    objective = Objective(vocab, {"terms": {"smmd": {}}}, fused=True)
    torch.manual_seed(0)
    x = logits.clone().requires_grad_(True)
    reference = objective(x, labels)
    reference.loss.backward()
    expected = x.grad
    x = logits.clone().requires_grad_(True)
    seen = []
    x.register_hook(lambda g: seen.append(g))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    objective(x, labels, grad_in_place=True).loss.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert seen[0].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert extra < 0.25 * logits.numel() * logits.element_size(), extra  # far below a second [T, V]
    torch.testing.assert_close(seen[0], expected, rtol=0, atol=0)


@pytest.mark.timeout(300)
@pytest.mark.skipif(triton_missing, reason="triton does not import")
def test_bench_gpu_losses_smoke_runs_both_parts_with_the_fused_kernels(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # the fused rows run under the interpreter on CPU
    env.pop("NUMLOSS_FUSED", None)
    proc = subprocess.run([sys.executable, "benchmarks/bench_gpu_losses.py", "--smoke", "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "bench_gpu_losses.json").read_text())
    assert report["fused"] is True
    rows = report["sections"]["losses"]["rows"]
    paths = {(r["N"], r["path"]) for r in rows}
    assert {(10, "numloss CE, grad in place"), (10, "numloss CE+ntil"), (1000, "numloss CE+smmd")} <= paths
    assert (1000, "numloss CE+ntil") not in paths
    assert all(r["ms"] > 0 and r["ratio"] > 0 for r in rows)
    head = {r["path"] for r in report["sections"]["head"]["rows"]}
    assert {"chunked head (from_hidden)", "logits path, grad in place"} <= head
    assert (tmp_path / "bench_gpu_losses.md").read_text().count("###") == 2
