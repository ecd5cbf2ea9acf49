"""One function per loss term: `fn(logits, labels, vocab, **options) -> 0-d tensor`.

Common arguments: `logits` [..., V] (any float dtype; the math is fp32), `labels` [...] aligned with
them (the caller shifts), `ignore_index` (-100). Parallel contract: with `group` (the tensor-parallel
process group) `logits` is this rank's vocab shard starting at `vocab_start`, labels are the same on
every rank, and the result and each rank's gradient of its shard equal the dense computation.

Each function returns its term alone (GCE its whole loss, since it replaces CE). To combine terms and
share the single pass over the logits, use `numloss.Objective`.
"""

from __future__ import annotations

import torch

from .logit_stats import IGNORE_INDEX, compute_logit_stats
from .losses import (
    cross_entropy_term,
    dist2_term,
    gce_term,
    ntil_term,
    ntl_mse_term,
    ntl_was_term,
    smmd_term,
)
from .vocab import NumericVocab


def _driven_by(term):
    """The logits-level function for a term: one `compute_logit_stats` pass, then the term's math."""

    def fn(
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab: NumericVocab,
        *,
        group=None,
        vocab_start: int = 0,
        ignore_index: int = IGNORE_INDEX,
        **options,
    ) -> torch.Tensor:
        stats = compute_logit_stats(logits, labels, vocab, group, vocab_start, ignore_index)
        return term(stats, vocab, **options)

    fn.__name__ = term.__name__.removesuffix("_term")
    fn.__qualname__ = fn.__name__
    fn.__doc__ = term.__doc__
    return fn


cross_entropy = _driven_by(cross_entropy_term)
ntl_was = _driven_by(ntl_was_term)
ntl_mse = _driven_by(ntl_mse_term)
gce = _driven_by(gce_term)
dist2 = _driven_by(dist2_term)
ntil = _driven_by(ntil_term)
smmd = _driven_by(smmd_term)

__all__ = ["cross_entropy", "ntl_was", "ntl_mse", "gce", "dist2", "ntil", "smmd"]
