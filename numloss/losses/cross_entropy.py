"""Token-mean cross-entropy, and the z-loss on the log-sum-exp."""

from __future__ import annotations

import torch

from ..logit_stats import LogitStats
from ..vocab import NumericVocab


def z_loss_term(stats: LogitStats, z_loss: float) -> torch.Tensor:
    """`z_loss * mean(lse^2)` over valid positions: keeps the softmax normaliser near 1."""
    lse = torch.where(stats.valid, stats.lse, torch.zeros_like(stats.lse))
    return z_loss * lse.square().sum() / max(stats.valid_count, 1)


def cross_entropy_term(stats: LogitStats, vocab: NumericVocab | None = None, z_loss: float = 0.0) -> torch.Tensor:
    """Mean CE over valid positions; plus the z-loss when z_loss > 0.

    With z_loss 0 nothing is added at all, so the value is exactly the plain CE (a stack that added a
    zero-weighted z-loss still changed the result's rounding and its graph).
    """
    loss = stats.ce_per_token.sum() / max(stats.valid_count, 1)
    return loss + z_loss_term(stats, z_loss) if z_loss else loss
