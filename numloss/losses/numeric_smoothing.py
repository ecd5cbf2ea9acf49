"""The soft-target control: label smoothing over the numeric tokens, at the numeric positions.

At a numeric position the term is `KL(u || p_model)` with `u` uniform over the N numeric tokens:
`-log N - (1/N) Σ_j log p_j`, mean over the numeric positions; the total is `CE + w·term`. It is
DIST2Loss with the distance taken out (DIST2's target `exp(-(v - y)²/τ)` tends to `u` as τ grows), so a
gain that DIST2, GCE, NTL or SMMD shows and this term shows too comes from a soft target, not from the
distances between the values.

The same thing read as label smoothing: `CE + w·KL(u || p) = (1 + w)·[(1 - ε)·CE + ε·H(u, p)] - w·log N`
at a numeric position, with ε = w / (1 + w), so its gradient is that of smoothing a mass ε uniformly
over the numeric tokens, at a step 1 + w times as long there (as every additive term lengthens it).

Why the numeric tokens and not the whole vocabulary: the distance-aware terms change the target at the
numeric positions only and only among the numeric tokens; smoothing over the whole vocabulary would also
change every text position, so a difference from CE could come from there. It also keeps the
vocab-parallel contract: what this term reads is the [M, N] numeric block (and, for "full", the global
log-sum-exp the CE pass has), never a sum over every column.

`normalize="full"` (default, as DIST2's paper mode) scores the full-vocabulary probabilities of the
numeric tokens; "numeric" renormalises over them (DIST2's code mode; then the term reads only the
numeric block). `weighting="place_value"` weighs each position by 1 + the numeric tokens after it in its
run and divides by the sum of the weights, as DIST2's code does, so each DIST2 mode has its control.
"""

from __future__ import annotations

import math

import torch

from ..logit_stats import LogitStats
from ..normalization import place_value_weights
from ..vocab import NumericVocab
from .common import full_log_probs, mean_or_zero, numeric_log_probs


def numeric_smoothing_term(stats: LogitStats, vocab: NumericVocab, normalize: str = "full", weighting: str = "none",
                           denominator: float | None = None) -> torch.Tensor:
    """`denominator`: the step's numeric positions (or Σ place-value weights); default this batch's."""
    if normalize not in ("full", "numeric"):
        raise ValueError(f"numeric_smoothing: normalize must be 'full' or 'numeric', got {normalize!r}")
    if weighting not in ("none", "place_value"):
        raise ValueError(f"numeric_smoothing: weighting must be 'none' or 'place_value', got {weighting!r}")
    num = stats.numeric
    log_model = full_log_probs(stats) if normalize == "full" else numeric_log_probs(stats)
    kl = -math.log(log_model.shape[-1]) - log_model.mean(dim=-1)  # N >= 1: a vocabulary has a numeric token
    weights = place_value_weights(stats.runs.after).to(kl.dtype) if weighting == "place_value" else None
    return mean_or_zero(kl, weights, denominator)
