"""The loss pass on one GPU: numloss's eager and fused passes beside torch's cross-entropy.

    python benchmarks/bench_gpu_losses.py [--out runs/bench_gpu_losses]   # one GPU, ~1-3 min
    python benchmarks/bench_gpu_losses.py --smoke                         # CPU, tiny: the code paths only

1. Logits [4, 2048, 128256] bf16 (a Llama-3 vocabulary, 8,192 tokens, 25% numeric labels), one forward +
   backward, median of 5 after a warm-up, the paths alternating: numloss CE eager (`fused=False`), numloss
   CE (the default dispatch: fused on a GPU with triton), the same with `grad_in_place=True`, every term on
   the default path at N = 10 and N = 1000, torch's eager cross-entropy (fp32 upcast) and torch.compile'd;
   then the cross-entropy paths alone at [4, 2048, 151936] (a Qwen2.5/3 vocabulary).
   Peak memory above the logits. The floor: two reads and one write of the bf16 logits at the bandwidth a
   large device copy measures here. Targets (printed, not enforced): numloss CE <= 1.2x compiled CE in time
   and <= it in memory; a term <= 1.10x of numloss CE at N = 10, <= 1.25x at N = 1000.
2. The chunked head (`Objective.from_hidden`, fused) against the logits path (hidden @ Wᵀ then the
   objective) at H = 4096 and 8192, bf16, CE + SMMD: time and peak above hidden and weight. Liger-Kernel's
   LigerFusedLinearCrossEntropyLoss / LigerCrossEntropyLoss beside them when `liger_kernel` imports.

Imports numloss and torch only (no DeepSpeed or Megatron). Output: tables on stdout, `<out>/bench_gpu_losses.json`
and `.md`. `benchmarks/gpu_check.py --sections losses` runs part 1 through `losses_table`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as TF

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from numloss import NumericVocab, Objective  # noqa: E402
from numloss.fused_pass import interpreting, triton_imports  # noqa: E402
from numloss.losses import TERMS, term_spec  # noqa: E402

LOSS_TARGETS = {"ce_vs_compiled": 1.2, 10: 1.10, 1000: 1.25}


def log(message: str) -> None:
    print(f"[bench_gpu_losses {time.strftime('%H:%M:%S')}] {message}", flush=True)


@dataclass
class LossSizes:
    device: str
    dtype: torch.dtype
    logits: tuple[int, int, int]  # [B, T, V]
    repeats: int
    hidden_sizes: tuple[int, ...]  # the chunked head's H
    more_vocabs: tuple[int, ...] = ()  # part 1's cross-entropy paths again at these vocabulary widths

    @classmethod
    def of(cls, smoke: bool) -> "LossSizes":
        if smoke:
            return cls("cpu", torch.float32, (2, 16, 1200), 2, (16,), (1500,))
        return cls("cuda", torch.bfloat16, (4, 2048, 128256), 5, (4096, 8192), (151936,))

    @property
    def fused(self) -> bool:
        """Whether the default dispatch runs the kernels here (on CPU only under the interpreter)."""
        return triton_imports() and (self.device == "cuda" or interpreting())


def synthetic_batch(sizes: LossSizes, n_numeric: int, numeric_share: float = 0.25, seed: int = 0):
    """Logits [B, T, V] on the device in the sizes' dtype, labels with `numeric_share` numeric ids,
    and the numeric vocabulary (ids 100 .. 100 + N, values 0 .. N-1; the decimal point 99, for DEL)."""
    b, t, v = sizes.logits
    g = torch.Generator().manual_seed(seed)
    vocab = NumericVocab(torch.arange(100, 100 + n_numeric), torch.arange(n_numeric), vocab_size=v,
                         decimal_point_id=99)
    labels = torch.randint(100 + n_numeric, v, (b * t,), generator=g)
    numeric = torch.rand(b * t, generator=g) < numeric_share
    labels[numeric] = torch.randint(100, 100 + n_numeric, (int(numeric.sum()),), generator=g)
    logits = torch.randn(b, t, v, generator=g).to(sizes.device, sizes.dtype)
    return vocab, logits, labels.view(b, t).to(sizes.device)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(run, device: str) -> tuple[float, float]:
    """(seconds, peak bytes above what was allocated before) of `run()`."""
    _sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    run()
    _sync(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - base if device == "cuda" else float("nan")
    return seconds, peak


def timed_pass(loss_fn, logits: torch.Tensor, labels: torch.Tensor, device: str) -> tuple[float, float]:
    """(seconds, peak bytes above the logits) of one forward + backward."""
    x = logits.detach().clone().requires_grad_(True)  # a fresh copy: a gradient in place overwrites it

    def run():
        loss_fn(x, labels).backward()
    result = timed(run, device)
    del x
    return result


def loss_paths(vocab: NumericVocab, n_numeric: int, sizes: LossSizes) -> dict:
    """name -> loss_fn(logits, labels) of every path part 1 compares."""
    def torch_ce(x, y):
        return TF.cross_entropy(x.float().reshape(-1, x.shape[-1]), y.reshape(-1), ignore_index=-100)

    def objective(terms: dict, fused=None, in_place=False):
        obj = Objective(vocab, {"terms": terms}, fused=fused)
        return lambda x, y: obj(x, y, grad_in_place=in_place).loss

    paths = {"torch eager CE (fp32 upcast)": torch_ce}
    if sizes.device == "cuda":
        paths["torch.compile CE"] = torch.compile(torch_ce)
    paths["numloss CE eager"] = objective({}, fused=False)
    paths["numloss CE"] = objective({})
    if sizes.fused:
        paths["numloss CE, grad in place"] = objective({}, in_place=True)
    for name in TERMS:
        if term_spec(name).vocab_problems(vocab):
            continue  # NTIL and DEL are defined on digit vocabularies only
        paths[f"numloss CE+{name}"] = objective({name: {}})
    return paths


def copy_bandwidth(device: str) -> float | None:
    """Bytes per second of a 2 GiB device-to-device copy (read + write), the floor's bandwidth."""
    if device != "cuda":
        return None
    src = torch.empty(2**30, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = statistics.median(timed(lambda: dst.copy_(src), device)[0] for _ in range(5))
    return 2 * src.numel() * src.element_size() / seconds


CE_PATHS = ("torch eager CE (fp32 upcast)", "torch.compile CE", "numloss CE eager", "numloss CE",
            "numloss CE, grad in place")


def _block(sizes: LossSizes, n: int, ce_only: bool) -> list[dict]:
    """The rows of one logits shape (`sizes.logits`) and numeric vocabulary N: every path, or the CE ones."""
    vocab, logits, labels = synthetic_batch(sizes, n)
    paths = {k: f for k, f in loss_paths(vocab, n, sizes).items() if not ce_only or k in CE_PATHS}
    v = sizes.logits[2]
    times = {name: [] for name in paths}
    peaks = {}
    for name, fn in paths.items():  # warm-up: kernels built, compiled graphs traced
        log(f"V={v} N={n} warm-up {name}")
        _, peaks[name] = timed_pass(fn, logits, labels, sizes.device)
    for _ in range(sizes.repeats):  # the paths alternate, so drift in clocks hits them alike
        for name, fn in paths.items():
            times[name].append(timed_pass(fn, logits, labels, sizes.device)[0])
    med = {name: statistics.median(t) for name, t in times.items()}
    ce = med["numloss CE"]
    compiled = med.get("torch.compile CE")
    rows = []
    for name in paths:
        target, mem_ratio = None, None
        if name.startswith("numloss CE+"):
            ratio, against, target = med[name] / ce, "numloss CE", LOSS_TARGETS[n]
        elif compiled:
            ratio, against = med[name] / compiled, "torch.compile CE"
            if name in ("numloss CE", "numloss CE, grad in place"):
                target = LOSS_TARGETS["ce_vs_compiled"]
                mem_ratio = peaks[name] / max(peaks["torch.compile CE"], 1)
        else:
            ratio, against = med[name] / ce, "numloss CE"
        within = None if target is None else ratio <= target and (mem_ratio is None or mem_ratio <= 1.0)
        rows.append({"V": v, "N": None if ce_only else n, "path": name, "ms": med[name] * 1e3,
                     "peak_gib": peaks[name] / 2**30, "ratio": ratio, "against": against, "target": target,
                     "mem_vs_compiled": mem_ratio, "within": within})
        log(f"V={v} N={n} {name}: {med[name] * 1e3:.2f} ms, peak {peaks[name] / 2**30:.2f} GiB, {ratio:.2f}x {against}")
    del logits
    return rows


def losses_table(sizes: LossSizes, on_block=None) -> dict:
    """Part 1's table; `on_block(table)` is called after each block (a shape and N) with the rows so far,
    so a caller that is cut off keeps what was measured."""
    b, t, v = sizes.logits
    vocabs = ", ".join(str(x) for x in (v, *sizes.more_vocabs))
    table = {"title": f"loss pass, logits [{b}, {t}, V] {str(sizes.dtype).replace('torch.', '')} (V = {vocabs}; the "
                      f"terms at V = {v}), forward + backward, median of {sizes.repeats}",
             "columns": ["V", "N", "path", "ms", "peak_gib", "ratio", "against", "target", "mem_vs_compiled", "within"],
             "rows": [], "ok": True}
    bandwidth = copy_bandwidth(sizes.device)
    if bandwidth:
        logits_bytes = b * t * v * torch.finfo(sizes.dtype).bits // 8
        table["rows"].append({"V": v, "N": None, "ms": 3 * logits_bytes / bandwidth * 1e3,
                              "path": f"floor (2 reads + 1 write of the logits at {bandwidth / 1e12:.2f} TB/s)"})
    blocks = [(sizes, 10, False), (sizes, 1000, False),
              *[(dataclasses.replace(sizes, logits=(b, t, wider)), 10, True) for wider in sizes.more_vocabs]]
    for block_sizes, n, ce_only in blocks:
        table["rows"] += _block(block_sizes, n, ce_only)
        if on_block is not None:
            on_block(table)
    return table


def head_table(sizes: LossSizes) -> dict:
    """Part 2: the chunked head against the logits path (and Liger's when it imports), CE + SMMD, N = 10."""
    try:
        from liger_kernel.transformers import LigerCrossEntropyLoss, LigerFusedLinearCrossEntropyLoss
    except Exception:  # noqa: BLE001  (absent or broken: its rows are left out)
        LigerCrossEntropyLoss = LigerFusedLinearCrossEntropyLoss = None
    b, t, v = sizes.logits
    rows = []
    for h in sizes.hidden_sizes:
        g = torch.Generator().manual_seed(1)
        vocab = NumericVocab(torch.arange(100, 110), torch.arange(10), vocab_size=v)
        labels = torch.randint(100, v, (b * t,), generator=g)
        labels[torch.rand(b * t, generator=g) < 0.25] = 105
        labels = labels.to(sizes.device)
        hidden = (torch.randn(b * t, h, generator=g) / h**0.25).to(sizes.device, sizes.dtype)
        weight = (torch.randn(v, h, generator=g) / h**0.25).to(sizes.device, sizes.dtype)
        objective = Objective(vocab, {"terms": {"smmd": {}}})
        paths = {
            "logits path (hidden @ Wᵀ, objective)": lambda x, w: objective(x @ w.t(), labels).loss,
            "logits path, grad in place": lambda x, w: objective(x @ w.t(), labels, grad_in_place=True).loss,
            "chunked head (from_hidden)": lambda x, w: objective.from_hidden(x, w, labels).loss,
        }
        if LigerFusedLinearCrossEntropyLoss is not None and sizes.device == "cuda":
            liger_flce, liger_ce = LigerFusedLinearCrossEntropyLoss(), LigerCrossEntropyLoss()
            paths["Liger fused linear CE (CE only)"] = lambda x, w: liger_flce(w, x, labels)
            paths["Liger CE on logits (CE only)"] = lambda x, w: liger_ce(x @ w.t(), labels)
        times = {name: [] for name in paths}
        peaks = {}
        for rep in range(1 + sizes.repeats):
            for name, fn in paths.items():
                x, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
                seconds, peak = timed(lambda: fn(x, w).backward(), sizes.device)
                if rep == 0:
                    peaks[name] = peak
                    log(f"H={h} warm-up {name}")
                else:
                    times[name].append(seconds)
                del x, w
        for name in paths:
            rows.append({"H": h, "path": name, "ms": statistics.median(times[name]) * 1e3,
                         "peak_gib": peaks[name] / 2**30,
                         "below_logits_path": None if not name.startswith("chunked") else
                         peaks[name] < peaks["logits path (hidden @ Wᵀ, objective)"]})
            log(f"H={h} {name}: {rows[-1]['ms']:.1f} ms, peak {rows[-1]['peak_gib']:.2f} GiB")
        del hidden, weight
    return {"title": f"head: {b * t} tokens, V = {v}, {str(sizes.dtype).replace('torch.', '')}, CE + SMMD (Liger: CE),"
                     " forward + backward, peak above hidden and weight",
            "columns": ["H", "path", "ms", "peak_gib", "below_logits_path"], "rows": rows, "ok": True}


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value).replace("|", "/").replace("\n", " ")


def markdown(section: dict) -> str:
    cols = [c for c in section["columns"] if any(c in r for r in section["rows"])]
    lines = [f"### {section['title']}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in section["rows"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench_gpu_losses")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: the code paths only")
    parser.add_argument("--parts", default="losses,head")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("bench_gpu_losses: no GPU here; --smoke runs the code paths on CPU", file=sys.stderr)
        return 2
    sizes = LossSizes.of(args.smoke)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}"
              if sizes.device == "cuda" else f"CPU, torch {torch.__version__}")
    if triton_imports():
        import triton
        device += f", triton {triton.__version__}"
    report = {"device": device, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "smoke": args.smoke,
              "fused": sizes.fused, "sections": {}}
    log(f"on {device}; fused kernels: {sizes.fused}")
    started = time.time()
    parts = {"losses": losses_table, "head": head_table}
    for name in args.parts.split(","):
        t0 = time.time()
        report["sections"][name] = parts[name](sizes)
        report["sections"][name]["seconds"] = time.time() - t0
        print("\n" + markdown(report["sections"][name]) + "\n", flush=True)
    report["seconds"] = time.time() - started
    (out / "bench_gpu_losses.json").write_text(json.dumps(report, indent=1, default=str))
    md = [f"# bench_gpu_losses, {report['date']}", "", device, ""]
    md += [markdown(s) + "\n" for s in report["sections"].values()]
    (out / "bench_gpu_losses.md").write_text("\n".join(md))
    log(f"done in {report['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
