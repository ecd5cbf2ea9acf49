"""numloss: numeric-aware token losses (SMMD, NTIL, NTL, DIST2, GCE, DEL), dense or vocab-parallel.

    vocab = NumericVocab.from_tokenizer(tokenizer, policy="digits")
    objective = Objective(vocab, {"terms": {"smmd": {}}})      # CE + 3.0 · SMMD
    out = objective(logits, labels)                            # out.loss, out.ce, out.terms

Over a step of several micro-batches and data-parallel ranks (`numloss.normalization`):

    step = reduce_counts([objective.counts(labels) for labels in window], group=dp_group)
    out = objective(logits, labels, counts=step)               # this micro-batch's share of the step

A term of your own (`numloss.losses.registry`; docs/losses.md), then named in any objective:

    numloss.register_term("my_term", my_term, default_weight=0.1)  # my_term(stats, vocab, *, denominator=None)

How much of the update each term drives (`numloss.diagnostics`):

    out = objective(logits, labels, counts=step, diagnostics=True)  # out.grad_sums: add over the step
    numloss.diagnostics.finalize(summed)                       # grad/<part>/norm, share, cos_ce
"""

from . import diagnostics, functional, fused_pass
from .logit_stats import IGNORE_INDEX, LogitStats, compute_logit_stats
from .losses.registry import register_term, unregister_term
from .objective import DEFAULT_WEIGHTS, Objective, ObjectiveConfig, ObjectiveOutput, TermConfig
from .normalization import LossCounts, reduce_counts
from .labels import shift_labels
from .parallel import count_comm
from .vocab import NumericVocab

__all__ = [
    "diagnostics",
    "functional",
    "fused_pass",
    "NumericVocab",
    "Objective",
    "ObjectiveConfig",
    "ObjectiveOutput",
    "TermConfig",
    "DEFAULT_WEIGHTS",
    "register_term",
    "unregister_term",
    "LogitStats",
    "compute_logit_stats",
    "count_comm",
    "LossCounts",
    "reduce_counts",
    "IGNORE_INDEX",
    "shift_labels",
]
