"""NTIL, the Numerical Token Integrity Loss: digit-level EMD plus whole-number errors.

Needs a digits vocabulary (values 0..9). A number is a maximal run of consecutive digit labels in a
sequence (`numloss.runs`). With `p` renormalised over the digit tokens:

- token level: `w_t · sum_j p_j |v_j - y_t|`, `w_t = digit_exp ** k_t`, k_t the digits after t in its run;
- sequence level, per run: the predicted number is rebuilt from a straight-through Gumbel-softmax
  sample of each digit (`tau`, `noise_scale`; noise 0 is deterministic), `x̂ = Σ d̂_t 10^k_t`, the target
  x likewise; relative error `|x̂ - x| / (max(x̂, x) + 1)` and magnitude error
  `log((max + 1) / (min + 1))`;
- per sequence: `digit_alpha · mean_t(token) + abs_alpha · mean_runs(rel) + mag_alpha · mean_runs(mag)`,
  0 for a sequence without digits; then the mean over sequences that have at least one valid label.

A sequence is a row of the labels, or with `sequence_ids` (labels-shaped; a packed row's segment ids)
each example of a packed row. `denominator` replaces this batch's count of sequences with a valid label
by the step's (`numloss.normalization`).

Everything is segment sums over run and sequence ids: no Python loop over tokens or sequences. The
numbers are rebuilt in float64, since 10^k overflows fp32's exact integers past seven digits.
"""

from __future__ import annotations

import torch

from ..logit_stats import LogitStats
from ..normalization import sequence_index, sequences_with_labels
from ..vocab import NumericVocab


def _segment_mean(values: torch.Tensor, segment: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Mean of `values` per segment id; 0 for an empty segment."""
    total = values.new_zeros(num_segments).index_add(0, segment, values)
    count = torch.bincount(segment, minlength=num_segments).clamp_min(1).to(values.dtype)
    return total / count


def _straight_through_digits(logits: torch.Tensor, values: torch.Tensor, tau: float, noise_scale: float,
                             generator: torch.Generator | None) -> torch.Tensor:
    """[M] sampled digit per position: forward the hard one-hot's value, backward the soft sample's."""
    scores = torch.log_softmax(logits, dim=-1)
    if noise_scale:
        # the generator, when given, must live on the logits' device (torch's rule for rand)
        uniform = torch.rand(scores.shape, generator=generator, device=scores.device).clamp_(1e-20, 1.0)
        scores = scores + noise_scale * -torch.log(-torch.log(uniform))
    soft = torch.softmax(scores / tau, dim=-1)
    hard = torch.zeros_like(soft).scatter_(1, soft.argmax(dim=-1, keepdim=True), 1.0)
    sample = hard - soft.detach() + soft
    return sample @ values


def ntil_term(
    stats: LogitStats,
    vocab: NumericVocab,
    digit_exp: float = 1.2,
    digit_alpha: float = 1.0,
    abs_alpha: float = 0.2,
    mag_alpha: float = 0.2,
    tau: float = 0.1,
    noise_scale: float = 0.01,
    generator: torch.Generator | None = None,
    sequence_ids: torch.Tensor | None = None,
    denominator: float | None = None,
) -> torch.Tensor:
    if not vocab.is_digits():
        raise ValueError(f"ntil needs a digits vocabulary (values 0..9); {vocab!r} is not one")
    if tau <= 0:
        raise ValueError(f"ntil: tau must be > 0, got {tau}")
    num = stats.numeric
    runs = stats.runs
    device = num.logits.device
    values = vocab.values_on(device)
    p = torch.softmax(num.logits, dim=-1)

    # token level: place-weighted EMD of each digit
    emd = (p * vocab.distances(device, torch.float32)[num.target]).sum(dim=-1)
    token_loss = emd * digit_exp ** runs.after.to(emd.dtype)

    # sequence level: rebuild each run's number
    place = torch.pow(10.0, runs.after.double())
    digits_hat = _straight_through_digits(num.logits, values, tau, noise_scale, generator).double()
    x_hat = torch.zeros(runs.num_runs, dtype=torch.float64, device=device).index_add(0, runs.run_id, digits_hat * place)
    x = torch.zeros(runs.num_runs, dtype=torch.float64, device=device).index_add(
        0, runs.run_id, vocab.values.to(device)[num.target] * place
    )
    high, low = torch.maximum(x_hat, x), torch.minimum(x_hat, x)
    relative = (x_hat - x).abs() / (high + 1)
    magnitude = torch.log((high + 1) / (low + 1))

    # sequences: rows, or the examples of packed rows (runs never cross them: an example's first
    # label is ignored)
    seq_index, n_seq = sequence_index(stats.shape, sequence_ids, device)
    seq_of_position = seq_index[num.rows]
    seq_of_run = torch.zeros(runs.num_runs, dtype=torch.long, device=device)
    seq_of_run[runs.run_id] = seq_of_position
    per_sequence = (
        digit_alpha * _segment_mean(token_loss, seq_of_position, n_seq).double()
        + abs_alpha * _segment_mean(relative, seq_of_run, n_seq)
        + mag_alpha * _segment_mean(magnitude, seq_of_run, n_seq)
    )
    has_valid = sequences_with_labels(stats.valid, seq_index, n_seq)
    if denominator is None:
        denominator = float(has_valid.sum())
    loss = (per_sequence * has_valid).sum() / (denominator if denominator > 0 else 1.0)
    return loss.to(torch.float32)
