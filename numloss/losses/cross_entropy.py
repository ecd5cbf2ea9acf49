"""Token-mean cross-entropy, and the z-loss on the log-sum-exp."""

from __future__ import annotations

import torch

from ..logit_stats import LogitStats
from ..vocab import NumericVocab


def token_denominator(stats: LogitStats, denominator: float | None) -> float:
    """What a token mean divides by: the step's token count when given, else this batch's valid
    labels; 1 when there are none (the sum is then 0)."""
    count = float(stats.valid_count) if denominator is None else float(denominator)
    return count if count > 0 else 1.0


def z_loss_term(stats: LogitStats, z_loss: float, denominator: float | None = None) -> torch.Tensor:
    """`z_loss * mean(lse^2)` over valid positions: keeps the softmax normaliser near 1."""
    lse = torch.where(stats.valid, stats.lse, torch.zeros_like(stats.lse))
    return z_loss * lse.square().sum() / token_denominator(stats, denominator)


def cross_entropy_term(stats: LogitStats, vocab: NumericVocab | None = None, z_loss: float = 0.0,
                       denominator: float | None = None) -> torch.Tensor:
    """Mean CE over valid positions (divided by `denominator`, the step's valid tokens, when given);
    plus the z-loss when z_loss > 0.

    With z_loss 0 nothing is added at all, so the value is exactly the plain CE (a stack that added a
    zero-weighted z-loss still changed the result's rounding and its graph).
    """
    loss = stats.ce_per_token.sum() / token_denominator(stats, denominator)
    return loss + z_loss_term(stats, z_loss, denominator) if z_loss else loss
