"""DIST2Loss: KL from a distance-shaped target distribution over the numeric tokens.

`p_d(v) ∝ exp(-(v - y)^2 / τ)`; the term is `KL(p_d || p_model)` at numeric positions, mean over them.
`normalize="full"` (the paper) scores the model's full-vocabulary probabilities of the numeric tokens;
"numeric" (the released code) renormalises over the numeric tokens. `weighting="place_value"` (the
released code) multiplies each position's KL by 1 + the number of numeric tokens after it in its run,
so the leading digit of 407 weighs 3 and the units digit 1, and, as there, the weighted sum is divided
by the sum of the weights (Σ w·KL / Σ w).
"""

from __future__ import annotations

import torch

from ..logit_stats import LogitStats
from ..vocab import NumericVocab
from ..normalization import place_value_weights
from .common import full_log_probs, mean_or_zero, numeric_log_probs


def dist2_term(
    stats: LogitStats,
    vocab: NumericVocab,
    tau: float = 1.0,
    normalize: str = "full",
    weighting: str = "none",
    denominator: float | None = None,
) -> torch.Tensor:
    """`denominator`: the step's numeric positions (or Σ place-value weights); default this batch's."""
    if tau <= 0:
        raise ValueError(f"dist2: tau must be > 0, got {tau}")
    if normalize not in ("full", "numeric"):
        raise ValueError(f"dist2: normalize must be 'full' or 'numeric', got {normalize!r}")
    if weighting not in ("none", "place_value"):
        raise ValueError(f"dist2: weighting must be 'none' or 'place_value', got {weighting!r}")
    num = stats.numeric
    squared = vocab.distances(num.logits.device, torch.float32).square()[num.target]
    log_target = torch.log_softmax(-squared / tau, dim=-1)
    log_model = full_log_probs(stats) if normalize == "full" else numeric_log_probs(stats)
    kl = (log_target.exp() * (log_target - log_model)).sum(dim=-1)
    weights = place_value_weights(stats.runs.after).to(kl.dtype) if weighting == "place_value" else None
    return mean_or_zero(kl, weights, denominator)
