"""Small pieces the loss terms share: reductions that are exactly 0 on empty input."""

from __future__ import annotations

import torch

from ..logit_stats import LogitStats


def mean_or_zero(per_item: torch.Tensor, weights: torch.Tensor | None = None,
                 denominator: float | None = None) -> torch.Tensor:
    """sum(x) / len(x), or sum(w * x) / sum(w) with weights (as the NTL and DIST2 releases reduce);
    divided by `denominator` instead when given (a count over the whole step, `numloss.normalization`).
    Exactly 0 (still attached to the graph) when there is no item.

    The sum of an empty tensor is 0 with a gradient path to the logits, so a batch without numeric
    positions trains the other terms and never produces NaN.
    """
    if denominator is None:
        denominator = float(per_item.numel()) if weights is None else float(weights.sum())
    if weights is not None:
        per_item = per_item * weights
    return per_item.sum() / (denominator if denominator > 0 else 1.0)


def numeric_position_weights(stats: LogitStats, position_weights: torch.Tensor | None) -> torch.Tensor | None:
    """Caller-given weights [...] (the labels' shape) picked at the numeric positions, or None."""
    if position_weights is None:
        return None
    if position_weights.shape != stats.shape:
        raise ValueError(f"position_weights {tuple(position_weights.shape)} must match labels {tuple(stats.shape)}")
    return position_weights.reshape(-1).to(stats.valid.device, torch.float32)[stats.numeric.rows]


def full_log_probs(stats: LogitStats) -> torch.Tensor:
    """[M, N] log of the full-vocabulary probability of each numeric token (uses the global lse)."""
    return stats.numeric.logits - stats.numeric.lse[:, None]


def numeric_log_probs(stats: LogitStats) -> torch.Tensor:
    """[M, N] log-probabilities renormalised over the numeric columns only."""
    return torch.log_softmax(stats.numeric.logits, dim=-1)


def numeric_mass(stats: LogitStats) -> torch.Tensor:
    """[M] the full-vocabulary probability mass on the numeric tokens."""
    return torch.exp(torch.logsumexp(stats.numeric.logits, dim=-1) - stats.numeric.lse)
