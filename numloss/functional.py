"""One function per loss term: `fn(logits, labels, vocab, **options) -> 0-d tensor` (DEL's is
`digit_entropy`; a registered term of your own: `term_function(name)`).

Common arguments: `logits` [..., V] (any float dtype; the math is fp32), `labels` [...] aligned with
them (the caller shifts), `ignore_index` (-100). Parallel contract: with `group` (the tensor-parallel
process group) `logits` is this rank's vocab shard starting at `vocab_start`, labels are the same on
every rank, and the result and each rank's gradient of its shard equal the dense computation.

Each function returns its term alone (GCE its whole loss, since it replaces CE), so that a term can be
added to a cross-entropy computed elsewhere: `F.cross_entropy(...) + 0.3 * numloss.functional.ntl_was(...)`.
A term renormalised over the numeric tokens (NTL-WAS, NTL-MSE, SMMD, NTIL, DEL, DIST2 and
numeric_smoothing with `normalize="numeric"`) then reads only the [M, N] numeric logits at the numeric positions, and its
gradient (M x N entries) is added in place into the dense gradient that the cross-entropy sends to the
same `logits` tensor (a hook on it): it costs next to nothing beside that cross-entropy. (Alone, the term
gives `logits` a dense gradient as usual; an incoming gradient it cannot write into is copied first.) With a TP group such a call
issues one collective. A term that needs the full-vocabulary normaliser (GCE, DIST2 and numeric_smoothing `normalize="full"`,
NTL `reweigh=True`) makes its own pass over the logits, as a cross-entropy does. To combine terms with
numloss's own cross-entropy and share that single pass, use `numloss.Objective`.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch

from .logit_stats import IGNORE_INDEX, compute_logit_stats, numeric_logit_stats
from .losses import cross_entropy_term, term_spec
from .vocab import NumericVocab

_NUMERIC_ONLY_NOTE = """

Called through `numloss.functional`{when}, it reads only the numeric columns at the numeric positions
(no pass over the vocabulary) and adds its gradient into the one a cross-entropy on the same `logits`
sends: added to a cross-entropy computed elsewhere it costs next to nothing."""
_FULL_VOCAB_NOTE = """

Called through `numloss.functional`{when}, it needs the full-vocabulary log-sum-exp, so it makes a pass
over all the logits (as a cross-entropy does); `numloss.Objective` shares that pass with its CE."""


def _driven_by(term, needs_full_vocab: Callable[[dict], bool], full_when: str = "", numeric_when: str = ""):
    """The logits-level function for a term: its math on `compute_logit_stats` (one pass over the
    logits) when `needs_full_vocab(options)`, else on `numeric_logit_stats` (the numeric slice only)."""
    signature = inspect.signature(term)

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
        bound = signature.bind_partial(**options)  # an unknown option is a TypeError that names it
        bound.apply_defaults()
        if needs_full_vocab(bound.arguments):
            stats = compute_logit_stats(logits, labels, vocab, group, vocab_start, ignore_index)
        else:
            stats = numeric_logit_stats(logits, labels, vocab, group, vocab_start, ignore_index)
        return term(stats, vocab, **options)

    fn.__name__ = term.__name__.removesuffix("_term")
    fn.__qualname__ = fn.__name__
    notes = ""
    if numeric_when is not None:
        notes += _NUMERIC_ONLY_NOTE.format(when=numeric_when)
    if full_when is not None:
        notes += _FULL_VOCAB_NOTE.format(when=full_when)
    fn.__doc__ = (term.__doc__ or fn.__name__) + notes
    fn.needs_full_vocab = needs_full_vocab
    return fn


def term_function(name: str, full_when: str | None = "", numeric_when: str | None = ""):
    """The logits-level function of the registered term `name` (a user's too): it makes the full pass
    over the vocabulary only when the term's registration says it needs the log-sum-exp with those
    options (`numloss.losses.registry`, need "full_vocab")."""
    spec = term_spec(name)
    return _driven_by(spec.fn, lambda options: "full_vocab" in spec.needs(options), full_when, numeric_when)


cross_entropy = _driven_by(cross_entropy_term, lambda o: True, numeric_when=None)
ntl_was = term_function("ntl_was", full_when=" with reweigh=True", numeric_when=" without reweigh")
ntl_mse = term_function("ntl_mse", full_when=" with reweigh=True", numeric_when=" without reweigh")
gce = term_function("gce", numeric_when=None)  # it scores every other position with CE
dist2 = term_function("dist2", full_when=' with normalize="full" (the default)', numeric_when=' with normalize="numeric"')
ntil = term_function("ntil", full_when=None)
smmd = term_function("smmd", full_when=None)
numeric_smoothing = term_function("numeric_smoothing", full_when=' with normalize="full" (the default)',
                                  numeric_when=' with normalize="numeric"')
_digit_entropy = term_function("del", full_when=None)


def digit_entropy(logits: torch.Tensor, labels: torch.Tensor, vocab: NumericVocab, decimal_point_id: int | None = None,
                  *, group=None, vocab_start: int = 0, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    return _digit_entropy(logits, labels, vocab, group=group, vocab_start=vocab_start, ignore_index=ignore_index,
                          decimal_point_id=decimal_point_id)


digit_entropy.__doc__ = (_digit_entropy.__doc__ + """

The Objective's term `del` is this value times its weight (default 0.01, the authors'). `vocab` must hold
exactly the ten digit tokens; `decimal_point_id` None takes the vocabulary's (`NumericVocab.from_tokenizer`
finds "."), and with neither, no run has a decimal point.""")
digit_entropy.needs_full_vocab = _digit_entropy.needs_full_vocab

__all__ = ["cross_entropy", "ntl_was", "ntl_mse", "gce", "dist2", "ntil", "smmd", "numeric_smoothing", "digit_entropy",
           "term_function"]
