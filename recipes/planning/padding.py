"""How long the micro-batches of a step are, padding included, as the engines pad them: the data's row
lengths (read from its shards), dealt out the way data_prep.reader deals a global batch, each
micro-batch padded to its own longest row (rounded up to data.pad_to_multiple_of and the engine's own
multiple), or every row to data.seq_len. The step model prices each micro-batch at its padded length.

The reader deals step s's G rows (positions [s G, (s + 1) G) of the seeded order) in blocks of b rows:
micro-batch a of data-parallel rank d is block a D + d. Rows are draws from the data's length
distribution F (a global batch is a small sample of a large epoch). Exact expectations, no sampling:
- without length bucketing a block is b independent rows: its padded length is the longest of b draws,
  P(max <= x) = F(x)^b;
- with bucketing the G rows are sorted longest first before they are dealt: block i holds the
  (i b + 1)-th longest of G draws, P(<= x) = P(Binomial(G, 1 - F(x)) <= i b).
Which micro-batches set the step's time (`Deal.critical`): when the ranks meet at every micro-batch
(ZeRO-2/3: `lockstep`) micro-batch a lasts as long as its longest block over the D ranks: without
bucketing the longest of D b draws, with it block a D (the first of its group: the longest); when they
meet at the step's end (Megatron, ZeRO 0-1), the slowest rank's micro-batches: with bucketing rank 0's
blocks a D, exactly (in every step each is the longest of its group); without, each the longest of b
draws, which leaves out how much one rank's sum of m micro-batches exceeds the mean (small for many
micro-batches). Interleaved 1F1B pads a rank's micro-batches to one length, the longest of its m b rows,
and the step waits for the rank holding the step's longest row.
Megatron under Transformer Engine (the GPU path) runs a micro-batch's real tokens back to back (THD,
`concat`): no padding but the micro-batch's round-up; its tokens are the sum of its rows' lengths (one
row: that row's distribution; several: the expected sum, or with bucketing each sorted block's).
A `Deal` counts tokens per micro-batch, padding included.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SAMPLE_ROWS = 200_000  # at most this many row lengths are read from the shards (row groups spread evenly)


def shard_row_lengths(path: str, max_rows: int = SAMPLE_ROWS) -> tuple[np.ndarray, bool] | None:
    """(tokens per row, whether every row was read) of the data_prep directory `path` (its input_ids'
    list lengths), or None when it has no manifest. At most about `max_rows` rows: whole row groups
    picked evenly across the shards."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    manifest = Path(path or "") / "manifest.json"
    if not path or not manifest.is_file():
        return None
    shards = json.loads(manifest.read_text()).get("shards", [])
    groups = []
    for shard in shards:
        meta = pq.ParquetFile(Path(path) / shard["file"]).metadata
        groups += [(shard["file"], g, meta.row_group(g).num_rows) for g in range(meta.num_row_groups)]
    total = sum(n for _, _, n in groups)
    if not total:
        return None
    stride = max(1, round(total / max_rows))
    out = []
    for file, g, _ in groups[::stride]:
        table = pq.ParquetFile(Path(path) / file).read_row_group(g, columns=["input_ids"])
        out.append(pc.list_value_length(table.column("input_ids")).to_numpy(zero_copy_only=False))
    return np.concatenate(out).astype(np.int64), stride == 1


@dataclass(frozen=True)
class Slots:
    """`count` micro-batches whose tokens (padding included) are `values` with probabilities `probs`."""

    count: int
    values: np.ndarray
    probs: np.ndarray

    def mean(self) -> float:
        """E[tokens] x count."""
        return self.count * float(self.values @ self.probs)

    @property
    def median(self) -> int:
        return int(self.values[min(int(np.searchsorted(np.cumsum(self.probs), 0.5)), len(self.values) - 1)])


@dataclass(frozen=True)
class Deal:
    """A layout's micro-batches (module docstring): `critical`, the slots on the step's critical path;
    `typical`, the distribution of any one micro-batch (a uniform mixture over every block); the
    expected tokens per global batch, real, padded, and the sum of squared row lengths (attention)."""

    critical: tuple[Slots, ...]
    typical: Slots
    rows: int
    real_tokens: float
    real_square_tokens: float
    padded_tokens: float

    @property
    def padding_ratio(self) -> float:
        return self.padded_tokens / self.real_tokens


def _distribution(lengths: np.ndarray, pad_multiple: int) -> tuple[np.ndarray, np.ndarray]:
    """(padded values ascending, their probabilities) of a row drawn from `lengths`."""
    padded = -(-np.asarray(lengths, dtype=np.int64) // pad_multiple) * pad_multiple
    values, counts = np.unique(padded, return_counts=True)
    return values, counts / counts.sum()


def _longest_of(cdf: np.ndarray, n: int) -> np.ndarray:
    """Probabilities of each value being the longest of n draws."""
    upper = cdf ** n
    return np.diff(np.concatenate([[0.0], upper]))


def _kth_longest(cdf: np.ndarray, g: int, ks: list[int]) -> list[np.ndarray]:
    """Probabilities of each value being the k-th longest of g draws, for each k in `ks`:
    P(X_(k) <= x) = P(Binomial(g, 1 - F(x)) <= k - 1)."""
    j = np.arange(g + 1)
    log_fact = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, g + 1)))])
    log_comb = log_fact[g] - log_fact[j] - log_fact[g - j]
    q = np.clip(1.0 - cdf, 0.0, 1.0)[:, None]  # P(a draw is longer than x)
    with np.errstate(divide="ignore", invalid="ignore"):
        log_pmf = log_comb + j * np.log(q) + (g - j) * np.log1p(-q)
    pmf = np.where(np.isnan(log_pmf), 0.0, np.exp(log_pmf))
    pmf[q[:, 0] == 0.0] = (j == 0)  # every draw <= x
    pmf[q[:, 0] == 1.0] = (j == g)  # every draw > x
    binom_cdf = np.cumsum(pmf, axis=1)
    out = []
    for k in ks:
        upper = np.clip(binom_cdf[:, k - 1], 0.0, 1.0)
        out.append(np.diff(np.concatenate([[0.0], upper])))
    return out


def deal(lengths: np.ndarray, *, micro_batch: int, micro_batches: int, dp: int, bucketing: bool,
         pad_multiple: int = 1, fixed: int | None = None, lockstep: bool = False, one_length: bool = False,
         concat: bool = False) -> Deal:
    """The reader's dealing as the engine pads it (module docstring), in tokens per micro-batch.
    `lengths`: the data's real row lengths (a sample); `fixed`: every row padded to this length
    (data.seq_len); `lockstep`: the ranks meet at every micro-batch; `one_length`: a rank's
    micro-batches padded to one length; `concat`: the rows' real tokens run back to back, the
    micro-batch rounded up to `pad_multiple` (Megatron's THD form)."""
    b, m, d = micro_batch, micro_batches, dp
    g = b * m * d
    real = np.asarray(lengths, dtype=np.float64)
    real_tokens, real_square = g * float(real.mean()), g * float((real ** 2).mean())

    def done(critical, typical: Slots, padded: float) -> Deal:
        return Deal(tuple(critical), typical, b, real_tokens, real_square, padded)

    if fixed is not None:
        one = Slots(m, np.array([b * -(-fixed // pad_multiple) * pad_multiple]), np.array([1.0]))
        return done([one], Slots(1, one.values, one.probs), g / b * float(one.values[0]))
    if concat and not one_length:
        return _concatenated(real, b, m, d, bucketing, pad_multiple, done)
    values, probs = _distribution(real, pad_multiple)
    cdf = np.cumsum(probs)
    cdf[-1] = 1.0
    tokens = b * values  # a micro-batch of b rows padded to its longest
    if not bucketing:
        block = Slots(1, tokens, _longest_of(cdf, b))
        if one_length:  # each rank pads to its longest of m b rows; the step waits for the longest of all
            own = Slots(1, tokens, _longest_of(cdf, m * b))
            return done([Slots(m, tokens, _longest_of(cdf, g))], own, g / b * own.mean())
        critical = Slots(m, tokens, _longest_of(cdf, d * b)) if lockstep else Slots(m, tokens, block.probs)
        return done([critical], block, g / b * block.mean())
    blocks = _kth_longest(cdf, g, [i * b + 1 for i in range(m * d)])  # block i: the (i b + 1)-th longest
    means = np.array(blocks) @ tokens  # the expected tokens of each block
    mixture = Slots(1, tokens, np.mean(blocks, axis=0))
    if one_length:  # rank d pads to its longest, block d; rank 0 holds the longest row of the step
        return done([Slots(m, tokens, blocks[0])], Slots(1, tokens, blocks[0]), m * float(means[:d].sum()))
    critical = [Slots(1, tokens, blocks[a * d]) for a in range(m)]  # rank 0's block, the longest of its group
    return done(critical, mixture, float(means.sum()))


def _concatenated(real: np.ndarray, b: int, m: int, d: int, bucketing: bool, pad_multiple: int, done) -> Deal:
    """Micro-batches of b rows' real tokens back to back (Megatron's THD form): one row, its length's
    distribution; b rows, their expected sum (the sum of b rows spreads little around it), or with
    bucketing each sorted block's expected sum; rounded up to `pad_multiple`. The ranks meet at the
    step's end: rank 0's blocks are the longest with bucketing."""

    def rounded(t):  # up to the multiple (expectations rounded to 1e-6 first: no ulp becomes a token)
        return np.ceil(np.round(np.asarray(t, dtype=np.float64) / pad_multiple, 6)) * pad_multiple

    g = b * m * d
    if not bucketing:
        if b == 1:
            values, probs = _distribution(real, pad_multiple)
        else:
            values, probs = rounded([b * real.mean()]).astype(np.int64), np.array([1.0])
        one = Slots(1, values, probs)
        return done([Slots(m, values, probs)], one, g / b * one.mean())
    values, counts = np.unique(real.astype(np.int64), return_counts=True)
    cdf = np.cumsum(counts / counts.sum())
    cdf[-1] = 1.0
    ranked = np.array(_kth_longest(cdf, g, list(range(1, g + 1)))) @ values  # E[k-th longest], k = 1..g
    sums = rounded(ranked.reshape(m * d, b).sum(axis=1)).astype(np.int64)  # block i: ranks i b + 1 .. (i + 1) b
    blocks, block_counts = np.unique(sums, return_counts=True)
    critical = [Slots(1, np.array([sums[a * d]]), np.array([1.0])) for a in range(m)]
    return done(critical, Slots(1, blocks, block_counts / block_counts.sum()), float(sums.sum()))
