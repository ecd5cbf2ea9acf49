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

from ..logit_stats import LogitStats, numeric_column
from ..normalization import sequence_index, sequences_with_labels
from ..sequence_split import counted_once, sum_over_split
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


def _number_errors(x_hat: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per run: the relative error |x̂ - x| / (max + 1) and the magnitude error log((max + 1) / (min + 1))."""
    high, low = torch.maximum(x_hat, x), torch.minimum(x_hat, x)
    return (x_hat - x).abs() / (high + 1), torch.log((high + 1) / (low + 1))


def _split_ntil(stats: LogitStats, vocab: NumericVocab, token_loss: torch.Tensor, weighted_digits: torch.Tensor,
                digit_alpha: float, abs_alpha: float, mag_alpha: float, denominator: float | None) -> torch.Tensor:
    """NTIL of this rank's positions of rows split along the sequence (`numloss.sequence_split`): its share
    of the whole rows' value, which the split's ranks' shares add up to.

    Each sequence's means divide by the whole sequence's digit positions and runs (labels only, from the
    whole rows). A run's x̂ is the sum of its digits' `weighted_digits` (d̂·10^k): a run inside this rank
    is rebuilt here; the parts of the runs that straddle ranks are summed over the split in one SUM
    all-reduce (every rank issues it when any run straddles: the whole rows say so alike on every rank),
    and each such run's errors count on the rank that holds its first digit."""
    view = stats.split
    device = weighted_digits.device
    whole = view.runs
    seq_index, n_seq = sequence_index(view.shape, view.split.sequence_ids, view.labels.device)
    numeric_flat = view.is_numeric.nonzero().flatten()
    seq_of_digit = seq_index[numeric_flat]  # [M_whole]
    seq_of_run = torch.zeros(whole.num_runs, dtype=torch.long, device=seq_of_digit.device)
    seq_of_run[whole.run_id] = seq_of_digit
    digits_per_seq = torch.bincount(seq_of_digit, minlength=n_seq).clamp_min(1)
    runs_per_seq = torch.bincount(seq_of_run, minlength=n_seq).clamp_min(1)

    index = view.whole_numeric(stats.numeric.rows)  # [M] whole numeric index of each local digit
    token_part = (token_loss / digits_per_seq[seq_of_digit[index]].to(token_loss.dtype).to(device)).sum().double()

    run_of_digit = whole.run_id[index]
    runs_here, local_run = torch.unique(run_of_digit, return_inverse=True)
    x_hat = torch.zeros(runs_here.numel(), dtype=torch.float64, device=device).index_add(0, local_run.to(device),
                                                                                         weighted_digits)
    # the target numbers, whole (labels only)
    target_column = numeric_column(view.labels, view.valid, vocab)[numeric_flat]
    x_whole = torch.zeros(whole.num_runs, dtype=torch.float64, device=numeric_flat.device).index_add(
        0, whole.run_id, vocab.values.to(numeric_flat.device)[target_column].double() * torch.pow(10.0, whole.after.double()))
    x = x_whole[runs_here].to(device)
    first_rank, straddles = view.run_owner()
    if bool(straddles.any()):
        if view.group is None:
            raise ValueError("ntil: a number straddles the sequence split, whose SequenceSplit has no process group"
                             " to sum its parts over")
        slot = straddles.long().cumsum(0) - 1  # [R_whole] slot of each straddling run
        crossing = straddles[runs_here]
        parts = torch.zeros(int(straddles.sum()), dtype=torch.float64, device=device).index_put(
            (slot[runs_here[crossing]].to(device),), x_hat[crossing.to(device)])
        summed = sum_over_split(parts, view.group)
        x_hat = torch.where(crossing.to(device), summed[slot[runs_here].clamp_min(0).to(device)], x_hat)
    relative, magnitude = _number_errors(x_hat, x)
    per_run = (abs_alpha * relative + mag_alpha * magnitude) / runs_per_seq[seq_of_run[runs_here]].to(device).double()
    here = (first_rank[runs_here] == view.rank).to(device)
    total = digit_alpha * token_part + counted_once(per_run, here).sum()
    if denominator is None:  # the whole rows' sequences with a valid label
        denominator = float(sequences_with_labels(view.valid, seq_index, n_seq).sum())
    return (total / (denominator if denominator and denominator > 0 else 1.0)).to(torch.float32)


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
    if stats.split is not None:
        return _split_ntil(stats, vocab, token_loss, digits_hat * place, digit_alpha, abs_alpha, mag_alpha,
                           denominator)
    x_hat = torch.zeros(runs.num_runs, dtype=torch.float64, device=device).index_add(0, runs.run_id, digits_hat * place)
    x = torch.zeros(runs.num_runs, dtype=torch.float64, device=device).index_add(
        0, runs.run_id, vocab.values.to(device)[num.target] * place
    )
    relative, magnitude = _number_errors(x_hat, x)

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
