"""A user's own terms, registered when the module is imported, as a plugin module registers its terms.

Imported by `losses/test_registry.py` inside a fixture that unregisters them afterwards (never at the top
of a test module: the registry is global to the process).
"""

from __future__ import annotations

import torch

import numloss
from numloss.losses.options import finite


def expected_error_term(stats, vocab, power: float = 1.0, denominator: float | None = None) -> torch.Tensor:
    """|E_p[v] - y|^power over the renormalised numeric distribution, mean over numeric positions."""
    num = stats.numeric
    values = vocab.values_on(num.logits.device)
    error = (torch.softmax(num.logits, dim=-1) @ values - values[num.target]).abs() ** power
    count = float(num.count) if denominator is None else float(denominator)
    return error.sum() / (count if count > 0 else 1.0)


def numeric_mass_gap_term(stats, vocab, denominator: float | None = None) -> torch.Tensor:
    """1 - the full-vocabulary probability of the numeric tokens, mean over numeric positions (needs the
    full-vocabulary log-sum-exp)."""
    num = stats.numeric
    mass = torch.exp(torch.logsumexp(num.logits, dim=-1) - num.lse)
    count = float(num.count) if denominator is None else float(denominator)
    return (1 - mass).sum() / (count if count > 0 else 1.0)


SEEN_SEQUENCE_IDS: list = []


def sequences_seen_term(stats, vocab, denominator: float | None = None, sequence_ids=None) -> torch.Tensor:
    """0 with a gradient path; records the sequence ids it was given (None or a tensor)."""
    SEEN_SEQUENCE_IDS.append(sequence_ids)
    return stats.numeric.logits.sum() * 0.0


NAMES = ("expected_error", "mass_gap", "sequences_seen")

numloss.register_term("expected_error", expected_error_term, default_weight=0.5,
                      options={"power": finite(0, strict=True)})
numloss.register_term("mass_gap", numeric_mass_gap_term, default_weight=0.2, needs=("full_vocab",))
numloss.register_term("sequences_seen", sequences_seen_term, default_weight=1.0, denominator="sequences")
