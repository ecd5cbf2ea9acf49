"""Peak memory and time of one forward+backward: the chunked head vs the logits path, swept over shapes.

    python benchmarks/bench_chunked.py [--scale 8] [--dtype bf16] [--rounds 2] [--steps 1] [--plot runs/bench/chunked.png]
    python benchmarks/bench_chunked.py --tokens 4096 --hidden 1024 --vocab 128256 --dtype fp32   # one shape

Both compute CE + SMMD (N = 1000 integer tokens, 20% numeric positions; the sweep divides N too) from hidden states [T, H] and an
lm_head weight [V, H], with hidden states and weight in `--dtype` (bf16 by default: the training shape):
- logits path: `Objective(h @ Wᵀ, labels)`, autograd through the matmul;
- chunked: `Objective.from_hidden(h, W, labels, chunk_size=C)`.

The sweep covers T in {1024, 4096, 8192} x H in {4096, 8192} at V = 128256 (Llama-3), every size
divided by `--scale` (8: T in {128, 512, 1024}, H in {512, 1024}, V = 16032, chunk cap 1024 / 8 = 128,
N = 1000 / 8 = 125). Dividing T, H, V, N and the chunk by the same factor keeps every ratio between the
buffers that matter ([T, V] logits, [V, H] weight gradient, [C, V] chunk, [T, H] hidden, [M, N] and
[N, H] numeric blocks), so the memory ratios are those of
the full shapes; the full shapes would take minutes per step here (bf16 matmuls run at ~18 GFLOPS on
these CPUs). Times are of the scaled shapes.

Cost: the chunked head cuts the vocabulary into chunks and does four GEMMs of [T, H] x [H, V] in all
(the logits, the same logits again in backward, d W, d hidden) against the logits path's three, so where
the GEMMs dominate (fp32 here, bf16 on a GPU) it takes about 4/3 of the logits path's time. On these CPUs
(no bf16 instructions) a bf16 matmul converts its operands to fp32 inside the kernel (RSS sees the copies;
a GPU has none): both heads convert the weight once per GEMM, but the logits path also converts its
[T, V] operands, which the chunked head's chunks keep small, so in bf16 it can be the faster here. Run
with `--dtype fp32` too: it shows the algorithm's own ratio without that artifact.

Threads: with the default thread count on a loaded machine (more runnable processes than cores) each op
waits at its parallel region's barrier for a thread that is not running, so the step time grows with
the number of ops, and the chunked head issues ~8x more (each op once per chunk); the time ratio then
measures the load. Run with `OMP_NUM_THREADS=1` as well (the children inherit it) to compare the heads.

Each (shape, variant) runs in its own process, after a small warm-up step (so library initialisation is
not counted). Two memory measures of what the step adds (logits, softmax, gradients, buffers, and d W,
the weight's gradient, [V, H], which both paths must produce):
- RSS: the process's maximum RSS minus its RSS just before the timed step; it includes the CPU-only
  fp32 operand copies of bf16 matmuls;
- tensor bytes: a second, untimed step under a dispatch mode that tracks the storages ATen ops allocate
  and frees (`live_tensor_peak`): the peak a GPU allocator would hold, without kernel scratch. The
  targets are judged on it. "excl. dW" subtracts d W's size from both peaks: conservative for the
  chunked head (the logits path's peak may come before its d W exists). Time is the fastest of `--rounds` processes
per variant, run alternately (logits, chunked, logits, ...) so load that comes and goes hits both alike;
each process times its first full-size step (first touch of every buffer included), or with `--steps K`
the fastest of K steps (the steady state a training loop sees).
Targets: chunked peak below the logits path's at every shape, at most 0.25x from T = 4096 up;
time at most 1.3x. With d W counted, a ratio below (d W) / (logits path peak) ≈ H / (5 T) is impossible
for any head; the table prints that bound.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

FULL_T = (1024, 4096, 8192)
FULL_H = (4096, 8192)
FULL_V = 128256
FULL_CHUNK = 1024


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def live_tensor_peak(step) -> int:
    """Peak bytes of tensor storages that ATen ops allocate while `step()` runs and that are alive at the
    same time: what a GPU caching allocator would have to hold. Scratch a CPU kernel allocates inside
    itself (the fp32 copies of a bf16 matmul's operands) is not a tensor and is not counted."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class LiveBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live, self.current, self.peak = {}, 0, 0

        def _free(self, key, nbytes):
            if self.live.pop(key, None) is not None:
                self.current -= nbytes

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor)}
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    key = storage.data_ptr()
                    if key and key not in self.live and key not in inputs:  # new (a view shares its input's)
                        self.live[key] = storage.nbytes()
                        self.current += storage.nbytes()
                        self.peak = max(self.peak, self.current)
                        weakref.finalize(storage, self._free, key, storage.nbytes())
            return out

    with LiveBytes() as counter:
        step()
    return counter.peak


def run_variant(args) -> dict:
    import torch

    from numloss import NumericVocab, Objective

    torch.manual_seed(0)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    n = args.numeric
    vocab = NumericVocab(torch.arange(200, 200 + n), torch.arange(n))  # works with any logits width
    objective = Objective(vocab, {"terms": {"smmd": {}}})

    def inputs(tokens, width, hidden_size):
        labels = torch.randint(200 + n, width, (tokens,))
        numeric = torch.rand(tokens) < 0.2
        labels[numeric] = torch.randint(200, 200 + n, (int(numeric.sum()),))
        hidden = torch.randn(tokens, hidden_size).to(dtype).requires_grad_(True)
        weight = (torch.randn(width, hidden_size) / hidden_size**0.5).to(dtype).requires_grad_(True)
        return hidden, weight, labels

    def step(hidden, weight, labels):
        if args.variant == "chunked":
            out = objective.from_hidden(hidden, weight, labels, chunk_size=args.chunk)
        else:
            out = objective(hidden @ weight.t(), labels)
        out.loss.backward()
        return float(out.loss)

    step(*inputs(16, 200 + n + 100, 16))  # warm-up at a tiny size: kernels and thread pools, not counted
    hidden, weight, labels = inputs(args.tokens, args.vocab, args.hidden)
    base = rss_bytes()
    start = time.perf_counter()
    loss = step(hidden, weight, labels)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    for _ in range(args.steps - 1):  # steady state: buffers already touched, allocator warm
        hidden.grad = weight.grad = None
        start = time.perf_counter()
        step(hidden, weight, labels)
        seconds = min(seconds, time.perf_counter() - start)
    hidden.grad = weight.grad = None
    tensor_peak = live_tensor_peak(lambda: step(hidden, weight, labels))  # a second step, not timed
    return {"variant": args.variant, "peak_bytes": peak, "tensor_bytes": tensor_peak, "seconds": seconds,
            "loss": loss, "grad_weight_bytes": weight.numel() * weight.element_size()}


def measure(tokens, hidden, vocab, chunk, dtype, rounds, numeric, steps=1) -> dict[str, dict]:
    """Alternate the variants' processes and keep, per variant, the fastest time and the largest peak."""
    results: dict[str, dict] = {}
    for _ in range(rounds):
        for variant in ("logits", "chunked"):
            cmd = [sys.executable, os.path.abspath(__file__), "--variant", variant, f"--tokens={tokens}",
                   f"--hidden={hidden}", f"--vocab={vocab}", f"--chunk={chunk}", f"--dtype={dtype}",
                   f"--numeric={numeric}", f"--steps={steps}"]
            r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
            best = results.get(variant)
            if best is None:
                results[variant] = r
            else:
                best["seconds"] = min(best["seconds"], r["seconds"])
                best["peak_bytes"] = max(best["peak_bytes"], r["peak_bytes"])
                best["tensor_bytes"] = max(best["tensor_bytes"], r["tensor_bytes"])
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=int, default=8, help="divide T, H, V and the chunk of the sweep by this")
    parser.add_argument("--tokens", type=int, help="one shape instead of the sweep (no scaling)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=FULL_V)
    parser.add_argument("--chunk", type=int, default=FULL_CHUNK)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--numeric", type=int, default=1000, help="N numeric tokens (the sweep divides it too)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating processes per variant and shape")
    parser.add_argument("--steps", type=int, default=1,
                        help="timed steps per process, the fastest kept (1: the first step only)")
    parser.add_argument("--plot", default="runs/bench/chunked.png", help="PNG of the sweep ('' for none)")
    parser.add_argument("--variant", choices=["chunked", "logits"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:  # child process: one variant, JSON on stdout
        print(json.dumps(run_variant(args)))
        return

    if args.tokens:
        shapes = [(args.tokens, args.hidden, args.tokens, args.hidden)]
        vocab, chunk, numeric = args.vocab, args.chunk, args.numeric
    else:
        s = args.scale
        shapes = [(t, h, t // s, h // s) for h in FULL_H for t in FULL_T]
        vocab, chunk, numeric = -(-FULL_V // s), FULL_CHUNK // s, args.numeric // s
    mib = 2**20
    print(f"CE + SMMD fwd+bwd, {args.dtype} hidden and weight, N={numeric}, 20% numeric, V={vocab}, chunk cap {chunk}"
          + (f"; full shapes / {args.scale} (V {FULL_V} / {args.scale})" if not args.tokens else "")
          + f"; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, load {os.getloadavg()[0]:.1f}")
    header = (f"{'T':>5} {'H':>5} | {'T run':>5} {'H run':>5} | RSS MiB {'logits':>7} {'chunked':>7} {'ratio':>6}"
              f" | tensor MiB {'logits':>7} {'chunked':>7} {'ratio':>6} {'bound':>6} {'excl.dW':>7}"
              f" | {'logits s':>8} {'chunked s':>9} {'ratio':>6} | {'loss diff':>9}  ok")
    print(header)
    rows, all_ok = [], True
    for t, h, t_run, h_run in shapes:
        r = measure(t_run, h_run, vocab, chunk, args.dtype, args.rounds, numeric, args.steps)
        lg, ch = r["logits"], r["chunked"]
        dw = lg["grad_weight_bytes"]
        rss = ch["peak_bytes"] / lg["peak_bytes"]
        mem = ch["tensor_bytes"] / lg["tensor_bytes"]
        excl = (ch["tensor_bytes"] - dw) / (lg["tensor_bytes"] - dw)
        bound = dw / lg["tensor_bytes"]
        speed = ch["seconds"] / lg["seconds"]
        ok = mem < 1.0 and speed <= 1.3 and (t < 4096 or excl <= 0.25)
        all_ok &= ok
        rows.append((t, h, mem, excl, bound, speed, rss))
        print(f"{t:>5} {h:>5} | {t_run:>5} {h_run:>5} | {'':7} {lg['peak_bytes'] / mib:7.1f} {ch['peak_bytes'] / mib:7.1f}"
              f" {rss:6.3f} | {'':10} {lg['tensor_bytes'] / mib:7.1f} {ch['tensor_bytes'] / mib:7.1f} {mem:6.3f}"
              f" {bound:6.3f} {excl:7.3f} | {lg['seconds']:8.2f} {ch['seconds']:9.2f} {speed:6.3f} |"
              f" {abs(ch['loss'] - lg['loss']):9.2e}  {'yes' if ok else 'NO'}")
    print("targets (on tensor bytes): ratio < 1 everywhere, excl.dW <= 0.25 from T=4096 up; time ratio <= 1.3: "
          + ("all met" if all_ok else "NOT ALL MET"))
    if args.plot and len(rows) > 1:
        plot(rows, args)


def plot(rows, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(10, 4))
    for h in sorted({r[1] for r in rows}):
        sel = [r for r in rows if r[1] == h]
        ts = [r[0] for r in sel]
        ax_mem.plot(ts, [r[2] for r in sel], "o-", label=f"H={h}, tensor bytes")
        ax_mem.plot(ts, [r[3] for r in sel], "s--", label=f"H={h}, tensor bytes excl. dW")
        ax_mem.plot(ts, [r[6] for r in sel], "^:", label=f"H={h}, RSS")
        ax_mem.plot(ts, [r[4] for r in sel], ":", color="gray")
        ax_time.plot(ts, [r[5] for r in sel], "o-", label=f"H={h}")
    ax_mem.axhline(1.0, color="k", lw=0.8)
    ax_mem.axhline(0.25, color="r", lw=0.8, ls="--")
    ax_time.axhline(1.3, color="r", lw=0.8, ls="--")
    for ax, title in ((ax_mem, "peak memory, chunked / logits (dotted: dW bound)"), (ax_time, "time, chunked / logits")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens T (full shape)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"chunked head vs logits path, {args.dtype}, V={FULL_V}, shapes / {args.scale} (measured)", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(args.plot) or ".", exist_ok=True)
    fig.savefig(args.plot, dpi=120)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
