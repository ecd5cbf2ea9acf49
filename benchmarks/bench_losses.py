"""Forward+backward time of CE plus each numeric term, relative to CE alone, measured in one run.

    python benchmarks/bench_losses.py [--tokens 8192] [--vocab 32000] [--repeats 5] [--table both]
                                      [--dtype fp32|bf16] [--terms del ...]

Logits [T, V] fp32 (or bf16) on CPU, numeric labels at 25% of positions and decimal points at 3%, N = 10
(digits) and N = 1000 (integers); the terms that need digits (NTIL, DEL) run at N = 10 only. Two tables, each row the median over repeats of forward + backward with CE plus one term,
divided by the median for CE alone, the two timed alternately:
- "objective": both through `numloss.Objective` (CE + that term at its default weight), so the ratio is
  what a numeric term costs on top of the pass over the logits that CE needs anyway;
- "standalone": `torch.nn.functional.cross_entropy(logits) + numloss.functional.<term>(logits, ...)`
  against torch's cross-entropy alone: a term called on its own, as users of the papers' packages do.
  Terms renormalised over the numeric tokens read only the numeric columns; the rows marked "full pass"
  (GCE, DIST2 paper mode, NTL reweigh) need the full-vocabulary normaliser and are shown without target.
Targets: at most 1.10 at N = 10 and 1.25 at N = 1000 for every term (standalone: every
term that needs no full pass); DEL: 1.10 standalone, 1.25 in the objective. `--terms` limits
the rows to those terms (DEL's line: `--terms del --dtype bf16 --vocab 151936`, docs/benchmarks.md).
`--table diagnostics` (not part of "both"): the same objective with and without the per-term gradient
diagnostics (`numloss.diagnostics`), for CE, CE + SMMD and CE + SMMD + NTL-WAS + DIST2 + GCE: what a
logged step's diagnostics add to the loss's forward + backward (no target).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as TF

import numloss.functional as F
from numloss import NumericVocab, Objective
from numloss.losses import TERMS, term_spec

TARGETS = {10: 1.10, 1000: 1.25}
TERM_TARGETS = {("objective", "del"): 1.25, ("standalone", "del"): 1.10}  # the issue's own, over the table's
POINT = 99  # the decimal point's token id

# (label, functional term, options) for the standalone table
STANDALONE = [
    ("ntl_was", "ntl_was", {}),
    ("ntl_mse", "ntl_mse", {}),
    ("smmd", "smmd", {}),
    ("ntil", "ntil", {}),
    ("del", "digit_entropy", {}),
    ("dist2/num", "dist2", {"normalize": "numeric"}),
    ("gce", "gce", {}),
    ("dist2", "dist2", {}),
    ("ntl_rw", "ntl_was", {"reweigh": True}),
]


def make_batch(tokens: int, vocab_size: int, n_numeric: int, numeric_share: float, seed: int = 0,
               dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    vocab = NumericVocab(torch.arange(100, 100 + n_numeric), torch.arange(n_numeric), vocab_size=vocab_size,
                         decimal_point_id=POINT)
    labels = torch.randint(100 + n_numeric, vocab_size, (tokens,), generator=g)
    draw = torch.rand(tokens, generator=g)
    numeric = draw < numeric_share
    labels[numeric] = torch.randint(100, 100 + n_numeric, (int(numeric.sum()),), generator=g)
    labels[(draw >= numeric_share) & (draw < numeric_share + 0.03)] = POINT
    logits = torch.randn(tokens, vocab_size, generator=g).to(dtype)
    return vocab, logits, labels.view(8, -1), logits.view(8, -1, vocab_size)


def serves(name: str, vocab: NumericVocab) -> bool:
    """Whether the term can run on this vocabulary (NTIL and DEL need digits)."""
    return not term_spec(name).vocab_problems(vocab)


def target(table: str, name: str, n: int) -> float:
    return TERM_TARGETS.get((table, name), TARGETS[n])


def step_seconds(objective: Objective, logits: torch.Tensor, labels: torch.Tensor) -> float:
    x = logits.detach().requires_grad_(True)
    start = time.perf_counter()
    objective(x, labels).loss.backward()
    return time.perf_counter() - start


def paired_medians(baseline, candidate, logits, labels, repeats: int, step=step_seconds):
    """Median step times of both, measured alternately so drift in machine load hits both alike."""
    step(baseline, logits, labels), step(candidate, logits, labels)  # warm-up, kernels built
    base, cand = [], []
    for _ in range(repeats):
        base.append(step(baseline, logits, labels))
        cand.append(step(candidate, logits, labels))
    return statistics.median(base), statistics.median(cand)


def loss_seconds(loss_fn, logits: torch.Tensor, labels: torch.Tensor) -> float:
    x = logits.detach().requires_grad_(True)
    start = time.perf_counter()
    loss_fn(x, labels).backward()
    return time.perf_counter() - start


def torch_ce(x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return TF.cross_entropy(x.reshape(-1, x.shape[-1]), labels.reshape(-1), ignore_index=-100)


def objective_table(args) -> bool:
    print(f"{'N':>5} {'term':>8} {'CE s':>8} {'CE+term s':>10} {'ratio':>6} {'target':>7}  ok")
    all_ok = True
    for n in (10, 1000):
        vocab, _, labels, logits = make_batch(args.tokens, args.vocab, n, args.numeric_share, dtype=args.dtype)
        ce = Objective(vocab, {"terms": {}})
        for name in TERMS:
            if not serves(name, vocab) or (args.terms and name not in args.terms):
                continue
            ce_time, t = paired_medians(ce, Objective(vocab, {"terms": {name: {}}}), logits, labels, args.repeats)
            ratio, goal = t / ce_time, target("objective", name, n)
            ok = ratio <= goal
            all_ok &= ok
            print(f"{n:>5} {name:>8} {ce_time:8.3f} {t:10.3f} {ratio:6.3f} {goal:7.2f}  {'yes' if ok else 'NO'}")
    return all_ok


def standalone_table(args) -> bool:
    print(f"{'N':>5} {'term':>9} {'torch CE s':>10} {'CE+term s':>10} {'ratio':>6} {'target':>9}  ok")
    all_ok = True
    for n in (10, 1000):
        vocab, _, labels, logits = make_batch(args.tokens, args.vocab, n, args.numeric_share, dtype=args.dtype)
        for label, name, options in STANDALONE:
            registered = "del" if name == "digit_entropy" else name
            if not serves(registered, vocab) or (args.terms and registered not in args.terms):
                continue
            term = getattr(F, name)
            full = term.needs_full_vocab({**_defaults(term, registered), **options})
            candidate = lambda x, y, term=term, options=options: torch_ce(x, y) + term(x, y, vocab, **options)  # noqa: E731
            ce_time, t = paired_medians(torch_ce, candidate, logits, labels, args.repeats, step=loss_seconds)
            ratio = t / ce_time
            if full:
                print(f"{n:>5} {label:>9} {ce_time:10.3f} {t:10.3f} {ratio:6.3f} {'full pass':>9}  -")
                continue
            goal = target("standalone", registered, n)
            ok = ratio <= goal
            all_ok &= ok
            print(f"{n:>5} {label:>9} {ce_time:10.3f} {t:10.3f} {ratio:6.3f} {goal:9.2f}  {'yes' if ok else 'NO'}")
    return all_ok


DIAGNOSED = {"ce": {"terms": {}}, "smmd": {"terms": {"smmd": {}}},
             "all": {"terms": {"smmd": {}, "ntl_was": {}, "dist2": {}, "gce": {"weight": 0.5}}}}


def diagnostics_table(args) -> bool:
    print(f"{'N':>5} {'objective':>9} {'off s':>8} {'on s':>8} {'ratio':>6}")
    for n in (10, 1000):
        vocab, _, labels, logits = make_batch(args.tokens, args.vocab, n, args.numeric_share, dtype=args.dtype)
        for name, spec in DIAGNOSED.items():
            off, on = paired_medians(Objective(vocab, spec), Objective(vocab, spec, diagnostics=True), logits, labels,
                                     args.repeats)
            print(f"{n:>5} {name:>9} {off:8.3f} {on:8.3f} {on / off:6.3f}")
    return True


def _defaults(term, name: str) -> dict:
    import inspect

    return {k: p.default for k, p in inspect.signature(TERMS[name]).parameters.items()
            if p.default is not inspect.Parameter.empty}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--numeric-share", type=float, default=0.25)
    parser.add_argument("--table", choices=["both", "objective", "standalone", "diagnostics"], default="both")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--terms", nargs="*", default=None, help="only these terms' rows (registered names)")
    args = parser.parse_args()
    unknown = sorted(set(args.terms or ()) - set(TERMS))
    if unknown:
        parser.error(f"--terms: unknown {unknown}; known: {sorted(TERMS)}")
    dtype_name, args.dtype = args.dtype, {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    print(f"logits [{args.tokens}, {args.vocab}] {dtype_name}, numeric share {args.numeric_share}, "
          f"threads {torch.get_num_threads()}, median of {args.repeats}")
    all_ok = True
    if args.table in ("both", "objective"):
        print("\n[objective] numloss.Objective: CE + term vs CE")
        all_ok &= objective_table(args)
    if args.table in ("both", "standalone"):
        print("\n[standalone] torch cross_entropy + numloss.functional.<term> vs torch cross_entropy")
        all_ok &= standalone_table(args)
    if args.table == "diagnostics":
        print("\n[diagnostics] numloss.Objective with the per-term gradient diagnostics vs without")
        all_ok &= diagnostics_table(args)
    print("all within target" if all_ok else "SOME ABOVE TARGET")


if __name__ == "__main__":
    main()
