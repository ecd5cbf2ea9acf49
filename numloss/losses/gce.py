"""GCE, Gaussian cross-entropy: CE against a Gaussian-smoothed target over the numeric tokens.

It replaces CE: on a numeric position the target is `g_j ∝ exp(-((v_j - y)/σ)^2 / 2)` over the numeric
tokens, scored with the full-vocabulary log-softmax; every other valid position keeps plain CE; the
mean runs over all valid positions. σ = 0 is the one-hot target, i.e. exactly CE.
"""

from __future__ import annotations

import torch

from ..logit_stats import LogitStats
from ..vocab import NumericVocab
from .common import full_log_probs, numeric_log_probs
from .cross_entropy import token_denominator


def gaussian_targets(vocab: NumericVocab, target: torch.Tensor, sigma: float) -> torch.Tensor:
    """[M, N] normalised Gaussian weights around each target's value."""
    values = vocab.values_on(target.device)
    z = (values[None, :] - values[target][:, None]) / sigma
    return torch.softmax(-0.5 * z.square(), dim=-1)


def gce_term(stats: LogitStats, vocab: NumericVocab, sigma: float = 1.0, renormalize: bool = False,
             denominator: float | None = None) -> torch.Tensor:
    """The whole GCE loss (it replaces CE). `renormalize` scores with the numeric-only softmax.
    `denominator`: the step's valid tokens (`numloss.normalization`); default this batch's."""
    if sigma < 0:
        raise ValueError(f"gce: sigma must be >= 0, got {sigma}")
    num = stats.numeric
    log_probs = numeric_log_probs(stats) if renormalize else full_log_probs(stats)
    if sigma == 0:
        numeric_loss = -log_probs.gather(1, num.target[:, None]).squeeze(1)
    else:
        numeric_loss = -(gaussian_targets(vocab, num.target, sigma) * log_probs).sum(dim=-1)
    per_token = stats.ce_per_token.index_put((num.rows,), numeric_loss)
    return per_token.sum() / token_denominator(stats, denominator)
