"""Bytes the vocab-parallel loss communicates per step, against gathering the full logits.

    python benchmarks/bench_comm.py [--tokens 8192] [--vocab 128256] [--numeric 1000] [--tp 8]
                                    [--numeric-share 0.2] [--skip-gather]

Llama-3-8B shapes by default: V = 128256, N = 1000 numeric tokens (the `integers` policy), 8192 tokens
per TP rank, TP = 8 (16032 vocab columns per rank), 20% numeric positions; fp32 logits.

It runs the real code path of one TP rank, `Objective(...)(local_logits, labels, group, vocab_start)`
forward and backward, on torch's fake process group (`FakeStore` + backend "fake": every collective
is issued with its real shapes and returns at once without data), and counts what numloss issues with
`numloss.count_comm()`. The fake backend moves no data, so the values it computes are meaningless;
only the counts are measured. The one-time layout exchange (first call on a new shard) needs the
other ranks' vocab ranges, so the bench hands that single all-gather the true ranges; the counted step
is the second, steady-state one. The comparison is one all-gather of every rank's [T, V/tp] logits
(what a loss needs when it cannot run on shards), issued through the same `numloss.parallel.all_gather`.

Two layouts of the numeric tokens bound the cost of moving the numeric columns: all N in rank 0's
slice (the ten digits of a Llama vocab sit in rank 0's slice) and spread evenly (N / TP per rank). The
numeric columns ride in one of the two collectives the log-sum-exp needs, by whichever route sends fewer
bytes (`numloss.parallel.choose_route`: the SUM all-reduce when one rank owns most columns, the
all-gather when they are spread). Each layout's line also gives the bytes of the previous scheme (three
collectives: MAX [T], SUM [2T], all-gather [M, width]), computed from the same shapes, for comparison.

Bytes: "input" is what one rank contributes (numloss's counter); "on the wire" is what one rank sends
with a ring algorithm: 2(p-1)/p x input for an all-reduce, (p-1) x input for an all-gather.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
import torch.distributed as dist

import numloss.parallel as parallel
from numloss import NumericVocab, Objective, count_comm


def wire_bytes(op: str, nbytes: int, world: int) -> float:
    if op.startswith("all_reduce"):
        return 2 * (world - 1) / world * nbytes
    if op == "all_gather":
        return (world - 1) * nbytes
    raise ValueError(op)


@contextlib.contextmanager
def true_layout_exchange(ranges: torch.Tensor):
    """The fake backend returns no data: give the layout exchange (a [2] long all-gather) the ranges."""
    original = parallel.all_gather

    def all_gather(tensor, group):
        if tensor.dtype == torch.long and tensor.shape == (2,):
            original(tensor, group)  # still issued (and counted), as in a real run
            return ranges.clone()
        return original(tensor, group)

    parallel.all_gather = all_gather
    try:
        yield
    finally:
        parallel.all_gather = original


def fmt(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(nbytes) < 1000 or unit == "GB":
            return f"{nbytes:,.1f} {unit}" if unit != "B" else f"{nbytes:,.0f} B"
        nbytes /= 1000
    raise AssertionError


def describe(records, world: int) -> tuple[str, int, float]:
    ops = ", ".join(f"{r.op}({fmt(r.bytes)})" for r in records)
    return ops, sum(r.bytes for r in records), sum(wire_bytes(r.op, r.bytes, world) for r in records)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--numeric", type=int, default=1000)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--numeric-share", type=float, default=0.2)
    ap.add_argument("--skip-gather", action="store_true", help="do not run the full-logits all-gather (T·V·4 bytes of memory)")
    args = ap.parse_args()

    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.manual_seed(0)
    world, T, V, N = args.tp, args.tokens, args.vocab, args.numeric
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    group = dist.group.WORLD
    per = -(-V // world)
    ranges = torch.tensor([[r * per, min(per, V - r * per)] for r in range(world)])
    v_local = int(ranges[0, 1])
    print(f"TP={world}  V={V}  V/tp={v_local}  tokens/rank={T}  N={N}  numeric share={args.numeric_share:.0%}"
          f"  (fake process group, measured on rank 0)")

    logits = torch.randn(T, v_local)  # this rank's fp32 shard
    g = torch.Generator().manual_seed(1)
    numeric_rows = torch.rand(T, generator=g) < args.numeric_share
    M = int(numeric_rows.sum())
    layouts = {
        f"all {N} numeric tokens in rank 0's slice": torch.arange(1000, 1000 + N),
        "numeric tokens spread evenly over the ranks": torch.arange(N) * (V // N) + 1,
    }
    results = []
    for name, token_ids in layouts.items():
        vocab = NumericVocab(token_ids, torch.arange(N, dtype=torch.float32), vocab_size=V)
        labels = torch.randint(V, (T,), generator=g)
        labels = torch.where(torch.isin(labels, token_ids), 0, labels)  # 0 is never numeric in these layouts
        labels[numeric_rows] = token_ids[torch.randint(N, (M,), generator=g)]
        labels = labels.view(1, T)
        objective = Objective(vocab, {"terms": {"smmd": {}, "ntl_was": {}, "gce": {"weight": 0.5}}})
        x = logits.view(1, T, v_local).requires_grad_(True)
        with true_layout_exchange(ranges), count_comm() as first:
            objective(x, labels, group=group, vocab_start=0).loss.backward()
        x.grad = None
        start = time.perf_counter()
        with count_comm() as forward:
            out = objective(x, labels, group=group, vocab_start=0)
        with count_comm() as backward:
            out.loss.backward()
        seconds = time.perf_counter() - start
        ops, nbytes, wire = describe(forward.records + backward.records, world)
        layout = vocab.memo(("layout", id(group), world, 0, 0, v_local), lambda: None)
        width = layout.width
        route = parallel.choose_route(T, M, layout)
        three = [("all_reduce_max", 4 * T), ("all_reduce_sum", 8 * T), ("all_gather", 4 * M * width)]
        three_wire = sum(wire_bytes(op, b, world) for op, b in three)
        print(f"\n[{name}]  M={M} numeric rows, widest rank owns {width} columns, route: {route}")
        print(f"  first call (layout exchange + step): {first.calls} collectives: {', '.join(first.ops())}")
        print(f"  steady-state step, forward: {forward.calls} collectives: {ops}")
        print(f"  steady-state step, backward: {backward.calls} collectives")
        print(f"  loss bytes/step/rank: input {fmt(nbytes)}, on the wire {fmt(wire)}   (fwd+bwd {seconds:.1f} s on CPU)")
        print(f"  previous scheme (3 collectives): on the wire {fmt(three_wire)}; now / previous = {wire / three_wire:.3f}")
        results.append((name, nbytes, wire))
        x.grad = None

    gather_input = T * v_local * 4
    if not args.skip_gather:
        with count_comm() as gather:
            full = parallel.all_gather(logits, group)  # [world, T, V/tp]: what a dense loss would need
        assert full.shape == (world, T, v_local)
        del full
        assert gather.calls == 1
        gather_input = gather.bytes
        how = "measured"
    else:
        how = "computed, not run"
    gather_wire = wire_bytes("all_gather", gather_input, world)
    print(f"\n[gather of full logits] 1 collective: all_gather({fmt(gather_input)}) ({how}); each rank then holds"
          f" {fmt(gather_input * world)}")
    print(f"  bytes/step/rank: input {fmt(gather_input)}, on the wire {fmt(gather_wire)}")
    print("\nratio (full-logits gather / vocab-parallel loss), wire bytes per rank:")
    for name, nbytes, wire in results:
        print(f"  {name}: {gather_wire / wire:,.0f}x  (input bytes: {gather_input / nbytes:,.0f}x)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
