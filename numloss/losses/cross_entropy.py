"""Token-mean cross-entropy, with an optional z-loss."""

from __future__ import annotations

import torch

from ..logit_stats import LogitStats
from ..vocab import NumericVocab


def cross_entropy_term(stats: LogitStats, vocab: NumericVocab | None = None, z_loss: float = 0.0) -> torch.Tensor:
    """Mean CE over valid positions; plus `z_loss * mean(lse^2)` when z_loss > 0.

    With z_loss 0 nothing is added at all, so the value is exactly the plain CE (a stack that added a
    zero-weighted z-loss still changed the result's rounding and its graph).
    """
    count = max(stats.valid_count, 1)
    loss = stats.ce_per_token.sum() / count
    if z_loss:
        lse = torch.where(stats.valid, stats.lse, torch.zeros_like(stats.lse))
        loss = loss + z_loss * lse.square().sum() / count
    return loss
