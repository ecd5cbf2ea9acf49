"""NTL, the Number Token Loss: Wasserstein-1 and regression losses on the numeric distribution.

Both use `p`, the distribution renormalised over the N numeric tokens, at numeric positions only, and
take the mean over those positions; with per-position weights `w` the weighted mean Σ w·l / Σ w (as
the `ntloss` package reduces). `denominator` replaces the batch's own count (or Σ w) with the step's
(`numloss.normalization`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..logit_stats import LogitStats
from ..vocab import NumericVocab
from .common import mean_or_zero, numeric_mass, numeric_position_weights

REWEIGH_MARGIN = 1.01


def _reweigh(per_position: torch.Tensor, stats: LogitStats, max_loss: torch.Tensor) -> torch.Tensor:
    """`l*m + 1.01*max_loss*(1-m)`, m the full-vocab numeric mass: a position that puts little mass on
    numbers gets close to the worst numeric loss instead of the loss of its renormalised leftovers."""
    mass = numeric_mass(stats)
    return per_position * mass + REWEIGH_MARGIN * max_loss * (1 - mass)


def ntl_was_term(
    stats: LogitStats,
    vocab: NumericVocab,
    squash_factor: float | None = None,
    reweigh: bool = False,
    position_weights: torch.Tensor | None = None,
    denominator: float | None = None,
) -> torch.Tensor:
    """NTL-WAS: `sum_j p_j |v_j - y|`, the Wasserstein-1 distance from p to the one-hot target.

    Distances, not a CDF over indices, so non-unit-spaced values (0.5, 1, 10, ...) are scored by how far
    apart they are. `squash_factor` maps non-zero distances onto [1, squash_factor].
    """
    num = stats.numeric
    distances = vocab.distances(num.logits.device, torch.float32, squash_factor)
    p = torch.softmax(num.logits, dim=-1)
    per_position = (p * distances[num.target]).sum(dim=-1)
    if reweigh:
        per_position = _reweigh(per_position, stats, distances.max())
    return mean_or_zero(per_position, numeric_position_weights(stats, position_weights), denominator)


def _regression(error: torch.Tensor, loss: str) -> torch.Tensor:
    if loss == "mse":
        return error.square()
    if loss == "mae":
        return error.abs()
    if loss == "huber":
        return F.huber_loss(error, torch.zeros_like(error), reduction="none", delta=1.0)
    raise ValueError(f"ntl_mse: unknown loss {loss!r}; expected 'mse', 'mae' or 'huber'")


def ntl_mse_term(
    stats: LogitStats,
    vocab: NumericVocab,
    loss: str = "mse",
    reweigh: bool = False,
    position_weights: torch.Tensor | None = None,
    denominator: float | None = None,
) -> torch.Tensor:
    """NTL-MSE: `(sum_j p_j v_j - y)^2` on the expected number; `loss` "mae" or "huber" instead."""
    num = stats.numeric
    values = vocab.values_on(num.logits.device)
    p = torch.softmax(num.logits, dim=-1)
    per_position = _regression(p @ values - values[num.target], loss)
    if reweigh:
        span = values.max() - values.min()
        per_position = _reweigh(per_position, stats, _regression(span.reshape(1), loss)[0])
    return mean_or_zero(per_position, numeric_position_weights(stats, position_weights), denominator)
