"""Loss normalisation over a whole optimizer step: one global denominator per kind of term.

Every loss value is a sum over its items divided by a count of its kind (which one: each term's
registration, `numloss.losses.registry`):

| key                       | what is counted                                          | terms                       |
|---------------------------|----------------------------------------------------------|-----------------------------|
| `tokens`                  | valid labels (not ignore_index)                          | CE, z-loss, GCE             |
| `numeric`                 | numeric positions (valid labels that are numbers)        | SMMD, NTL-WAS/MSE, DIST2, DEL |
| `place_value`             | Σ over numeric positions of 1 + numeric tokens after it  | DIST2 place-value weighting |
| `sequences`               | sequences (packed rows: examples) with a valid label     | NTIL                        |
| `<term>.position_weights` | Σ of the caller's position weights at numeric positions  | NTL with `position_weights` |

One step often spans several micro-batches (gradient accumulation) and data-parallel ranks. If each
micro-batch divides by its own count, a micro-batch with 3 numeric positions weighs as much as one
with 300, and the trainer's averaging of micro-batches and ranks then makes the update depend on how
the global batch was split. Instead every count is taken over the whole step: count each micro-batch
from its labels alone (no forward needed), sum the counts of the step's micro-batches and ranks (one
small SUM all-reduce, before the first forward), and give the objective those totals. Each
micro-batch's loss is then its share of the step's loss, and the shares of every micro-batch on every
rank add up to the loss of the whole global batch taken at once, at any layout. (The same idea as
Megatron-core's `calculate_per_token_loss`, torchtitan's global token count and the Hugging Face
Trainer's `num_items_in_batch`, extended to the numeric terms' own denominators.)

    counts = [objective.counts(labels) for labels in window]      # labels only, this rank
    step = reduce_counts(counts, group=dp_group)                  # one SUM all-reduce
    for logits, labels in window:
        out = objective(logits, labels, counts=step)              # this micro-batch's share
        (out.loss * dp_size).backward()                           # undo DDP's mean over ranks

A trainer that averages gradients over `d` data-parallel ranks and `g` accumulated micro-batches (as
DeepSpeed does) must scale each micro-batch's loss by `d · g` to undo that mean. Tensor-parallel ranks
hold the same labels, so they add nothing: reduce over the data-parallel group only.

Without `counts` the objective divides by the batch's own counts (one micro-batch on one rank: the
same value). `rescale_to_ce` (a term scaled to CE's value) is a ratio of the micro-batch's own CE and
term, so it is the one option whose value still depends on the split.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch
import torch.distributed as dist

from .logit_stats import IGNORE_INDEX, numeric_column
from .parallel import record_collective
from .runs import numeric_runs
from .vocab import NumericVocab

TOKENS, NUMERIC, PLACE_VALUE, SEQUENCES = "tokens", "numeric", "place_value", "sequences"


@dataclass(frozen=True)
class LossCounts:
    """Denominators by key (see the module docstring): of one batch, or summed over a whole step."""

    values: Mapping[str, float] = field(default_factory=dict)

    def __getitem__(self, key: str) -> float:
        try:
            return self.values[key]
        except KeyError:
            raise KeyError(f"LossCounts has no count {key!r} (it has {sorted(self.values)}); count the"
                           " batches with the same objective that uses them") from None

    def __add__(self, other: "LossCounts") -> "LossCounts":
        if set(self.values) != set(other.values):
            raise ValueError(f"cannot add counts of different kinds: {sorted(self.values)} and {sorted(other.values)}")
        return LossCounts({k: self.values[k] + other.values[k] for k in self.values})

    def denominator(self, key: str) -> float:
        """The count to divide by: the count itself, or 1 when it is 0 (the sum is then 0 too)."""
        value = self[key]
        return value if value > 0 else 1.0

    @classmethod
    def total(cls, counts: Iterable["LossCounts"]) -> "LossCounts":
        out = None
        for c in counts:
            out = c if out is None else out + c
        if out is None:
            raise ValueError("no counts to add up: a step needs at least one micro-batch")
        return out


def reduce_counts(counts: Iterable[LossCounts] | LossCounts, group=None) -> LossCounts:
    """The counts of a whole step: this rank's micro-batches summed, then summed over `group`.

    Parallel contract: every rank of `group` (the data-parallel group, with the sequence-split ranks when
    rows are split along the sequence: `numloss.sequence_split`; never the tensor-parallel one, whose
    ranks see the same labels) calls it once per step with counts of the same keys; one SUM
    all-reduce of a float64 vector (exact for counts below 2^53). Without an initialised process group,
    or with `group` of size 1, no communication."""
    local = counts if isinstance(counts, LossCounts) else LossCounts.total(counts)
    keys = sorted(local.values)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return local
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    packed = torch.tensor([float(local.values[k]) for k in keys], dtype=torch.float64, device=device)
    record_collective("all_reduce_sum", packed)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    return LossCounts(dict(zip(keys, packed.tolist())))


# ---- the counting, shared by the terms (their own default denominators) and by `batch_counts` ----------


def numeric_label_mask(labels: torch.Tensor, vocab: NumericVocab, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """[...] True where the label is a numeric token of `vocab` (ignored labels are not)."""
    return numeric_column(labels, labels != ignore_index, vocab) >= 0


def place_value_weights(after: torch.Tensor) -> torch.Tensor:
    """DIST2's place-value weight of each numeric position: 1 + the numeric tokens after it in its run
    (the leading digit of 407 weighs 3, the units digit 1)."""
    return (1 + after).to(torch.float32)


def sequence_index(shape: torch.Size, sequence_ids: torch.Tensor | None, device) -> tuple[torch.Tensor, int]:
    """([T] dense sequence index of every flat position, number of sequences).

    Without `sequence_ids` every row (the last dimension of `shape`) is one sequence. With them
    (labels-shaped, e.g. a packed row's segment ids), positions of one row with the same id form one
    sequence: ids are compared within a row only, and need not be contiguous."""
    seq_len = shape[-1] if len(shape) else 1
    total = int(torch.Size(shape).numel())
    rows = torch.arange(total, device=device) // max(seq_len, 1)
    if sequence_ids is None:
        return rows, total // max(seq_len, 1)
    if sequence_ids.shape != shape:
        raise ValueError(f"sequence_ids {tuple(sequence_ids.shape)} must match the labels {tuple(shape)}")
    ids = sequence_ids.reshape(-1).to(device=device, dtype=torch.long)
    ids = ids - ids.min() if ids.numel() else ids
    key = rows * (int(ids.max()) + 1 if ids.numel() else 1) + ids
    unique, index = torch.unique(key, return_inverse=True)
    return index, unique.numel()


def sequences_with_labels(valid: torch.Tensor, index: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """[S] bool: the sequences holding at least one valid label (NTIL averages over these)."""
    hits = torch.zeros(num_sequences, dtype=torch.long, device=valid.device).index_add_(0, index, valid.long())
    return hits > 0


def batch_counts(
    labels: torch.Tensor,
    vocab: NumericVocab,
    keys: Iterable[str],
    ignore_index: int = IGNORE_INDEX,
    sequence_ids: torch.Tensor | None = None,
    position_weights: Mapping[str, torch.Tensor] | None = None,
) -> LossCounts:
    """The counts `keys` of one batch, from its (shifted, logits-aligned) labels alone.

    `position_weights` maps a `<term>.position_weights` key to that term's labels-shaped weights.
    `Objective.counts` calls this with the keys its terms need."""
    labels = labels.detach()
    valid = labels != ignore_index
    out: dict[str, float] = {}
    numeric = None
    for key in sorted(set(keys)):
        if key == TOKENS:
            out[key] = float(valid.sum())
            continue
        if key == SEQUENCES:
            index, n = sequence_index(labels.shape, sequence_ids, labels.device)
            out[key] = float(sequences_with_labels(valid.reshape(-1), index, n).sum())
            continue
        if numeric is None:
            numeric = numeric_label_mask(labels, vocab, ignore_index)
        if key == NUMERIC:
            out[key] = float(numeric.sum())
        elif key == PLACE_VALUE:
            out[key] = float(place_value_weights(numeric_runs(numeric).after).sum())
        elif key.endswith(".position_weights"):
            weights = (position_weights or {}).get(key)
            if weights is None or weights.shape != labels.shape:
                raise ValueError(f"count {key!r} needs that term's position_weights shaped like the labels"
                                 f" {tuple(labels.shape)}")
            out[key] = float(weights.to(torch.float32)[numeric].sum())
        else:
            raise ValueError(f"unknown count {key!r}; known: {TOKENS}, {NUMERIC}, {PLACE_VALUE}, {SEQUENCES},"
                             " <term>.position_weights")
    return LossCounts(out)
