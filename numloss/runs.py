"""Numbers as runs of numeric tokens.

With a digit tokenizer the number 407 is three labels "4" "0" "7". NTIL weighs and reconstructs whole
numbers, and DIST2's place-value weighting needs each digit's place, so both need the maximal runs of
consecutive numeric labels. Runs end at any non-numeric or ignored label and at the end of a sequence
(the last dimension of the labels). Computed without a Python loop over tokens: a run starts where a
numeric label follows a non-numeric one, and cumulative sums number the runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class NumericRuns:
    """Per numeric position (in flat order, the order of `NumericRows.rows`) and per run."""

    run_id: torch.Tensor  # [M] run of each numeric position, 0..R-1 in flat order
    after: torch.Tensor  # [M] numeric tokens after this one in its run (its place: 0 = units)
    seq_of_position: torch.Tensor  # [M] sequence index of each numeric position
    seq_of_run: torch.Tensor  # [R] sequence index of each run
    run_length: torch.Tensor  # [R]
    num_sequences: int

    @property
    def num_runs(self) -> int:
        return self.run_length.numel()


def numeric_runs(is_numeric: torch.Tensor) -> NumericRuns:
    """Runs of `is_numeric` [..., S] (True where the label is a numeric token) along the last dim."""
    if is_numeric.dim() == 0:
        raise ValueError("labels must have at least one dimension")
    seq_len = is_numeric.shape[-1]
    flags = is_numeric.reshape(-1, seq_len)
    num_sequences = flags.shape[0]
    previous = torch.zeros_like(flags)
    previous[:, 1:] = flags[:, :-1]
    starts = (flags & ~previous).reshape(-1)
    flat = flags.reshape(-1)
    positions = flat.nonzero().flatten()  # [M]
    run_id = (starts.long().cumsum(0) - 1)[positions]
    num_runs = int(starts.sum())
    run_length = torch.bincount(run_id, minlength=num_runs)
    # index of the last position of each run, then the count of run members after each position
    last = torch.zeros(num_runs, dtype=torch.long, device=flat.device).scatter_reduce_(
        0, run_id, positions, reduce="amax", include_self=False
    )
    after = last[run_id] - positions
    seq_of_position = positions // seq_len
    seq_of_run = torch.zeros(num_runs, dtype=torch.long, device=flat.device)
    seq_of_run[run_id] = seq_of_position
    return NumericRuns(run_id, after, seq_of_position, seq_of_run, run_length, num_sequences)
