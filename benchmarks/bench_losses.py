"""Forward+backward time of CE plus each numeric term, relative to CE alone, measured in one run.

    python benchmarks/bench_losses.py [--tokens 8192] [--vocab 32000] [--repeats 5]

Logits [T, V] fp32 on CPU, numeric labels at 25% of positions, N = 10 (digits) and N = 1000
(integers). Each row is the median over repeats of (objective forward + backward) with CE + that term
at its default weight, divided by the median for CE alone, the two timed alternately; both go through `numloss.Objective`, so the
ratio is what a numeric term costs on top of the pass over the logits that CE needs anyway.
Targets (issue 2): at most 1.10 at N = 10 and 1.25 at N = 1000 for every term.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from numloss import NumericVocab, Objective
from numloss.losses import TERMS

TARGETS = {10: 1.10, 1000: 1.25}


def make_batch(tokens: int, vocab_size: int, n_numeric: int, numeric_share: float, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    vocab = NumericVocab(torch.arange(100, 100 + n_numeric), torch.arange(n_numeric), vocab_size=vocab_size)
    labels = torch.randint(100 + n_numeric, vocab_size, (tokens,), generator=g)
    numeric = torch.rand(tokens, generator=g) < numeric_share
    labels[numeric] = torch.randint(100, 100 + n_numeric, (int(numeric.sum()),), generator=g)
    logits = torch.randn(tokens, vocab_size, generator=g)
    return vocab, logits, labels.view(8, -1), logits.view(8, -1, vocab_size)


def step_seconds(objective: Objective, logits: torch.Tensor, labels: torch.Tensor) -> float:
    x = logits.detach().requires_grad_(True)
    start = time.perf_counter()
    objective(x, labels).loss.backward()
    return time.perf_counter() - start


def paired_medians(baseline: Objective, candidate: Objective, logits, labels, repeats: int):
    """Median step times of both, measured alternately so drift in machine load hits both alike."""
    step_seconds(baseline, logits, labels), step_seconds(candidate, logits, labels)  # warm-up, kernels built
    base, cand = [], []
    for _ in range(repeats):
        base.append(step_seconds(baseline, logits, labels))
        cand.append(step_seconds(candidate, logits, labels))
    return statistics.median(base), statistics.median(cand)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--numeric-share", type=float, default=0.25)
    args = parser.parse_args()
    print(f"logits [{args.tokens}, {args.vocab}] fp32, numeric share {args.numeric_share}, "
          f"threads {torch.get_num_threads()}, median of {args.repeats}")
    print(f"{'N':>5} {'term':>8} {'CE s':>8} {'CE+term s':>10} {'ratio':>6} {'target':>7}  ok")
    all_ok = True
    for n in (10, 1000):
        vocab, _, labels, logits = make_batch(args.tokens, args.vocab, n, args.numeric_share)
        ce = Objective(vocab, {"terms": {}})
        for name in TERMS:
            if name == "ntil" and not vocab.is_digits():
                continue  # NTIL is defined on digit vocabularies only
            ce_time, t = paired_medians(ce, Objective(vocab, {"terms": {name: {}}}), logits, labels, args.repeats)
            ratio = t / ce_time
            ok = ratio <= TARGETS[n]
            all_ok &= ok
            print(f"{n:>5} {name:>8} {ce_time:8.3f} {t:10.3f} {ratio:6.3f} {TARGETS[n]:7.2f}  {'yes' if ok else 'NO'}")
    print("all within target" if all_ok else "SOME ABOVE TARGET")


if __name__ == "__main__":
    main()
