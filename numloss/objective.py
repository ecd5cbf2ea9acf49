"""The training objective: cross-entropy plus any weighted set of numeric terms, from a typed config.

    total = CE + Σ_k w_k · term_k                       (ntl_was, ntl_mse, dist2, ntil, smmd, del)
    total = (1 - w) · CE + w · GCE  + Σ_k w_k · term_k  (GCE replaces CE; w = 1 by default)

The terms are those registered in `numloss.losses.registry` (the built-in ones and any a user registers
with `numloss.register_term`); each one's default weight, option rules, vocabulary needs and count come
from its registration.

All terms share one pass over the logits (`compute_logit_stats`), so adding a term costs only its
[M, N] math at the M numeric positions. A term listed with weight 0 is still computed and reported but
adds exactly nothing: every weight 0 gives plain CE, value and gradient.

Normalisation: each term divides its sum by a count of its kind (valid tokens, numeric positions,
sequences, ...). By default these are the batch's own counts; with `counts=` (the whole optimizer step's,
from `Objective.counts` and `numloss.normalization.reduce_counts`) each micro-batch's output is its
share of the step's loss, and the shares add up to the loss of the whole global batch at any layout.

Diagnostics: with `diagnostics=True` (the constructor's default for every call, or per call) the output
also carries `grad_sums`, each part's gradient on the numeric block as additive sums
(`numloss.diagnostics`); loss and gradients are the same to the bit with or without.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from .chunked_head import DEFAULT_CHUNK_SIZE, chunked_logit_stats
from .diagnostics import gradient_sums, with_numeric_block
from .logit_stats import IGNORE_INDEX, LogitStats, compute_logit_stats
from .losses import DEFAULT_WEIGHTS, cross_entropy_term, registered_terms, term_spec
from .losses.cross_entropy import z_loss_term
from .losses.options import finite
from .normalization import TOKENS, LossCounts, batch_counts
from .sequence_split import SequenceSplit, replace_split, split_counts, whole_counts
from .vocab import NumericVocab

__all__ = ["DEFAULT_WEIGHTS", "Objective", "ObjectiveConfig", "ObjectiveConfigError", "ObjectiveOutput", "TermConfig"]


@dataclass
class TermConfig:
    """One numeric term: its weight (None: the default weight) and its options (the term's kwargs).

    `rescale_to_ce` is the NTIL release's normalisation, available for any term: the term enters as
    `stopgrad(CE / term) · w · term`, so the total's value stays `(1 + w) · CE` while the gradient
    direction still comes from the term. The ratio is taken per micro-batch, so with step-global
    counts (`numloss.normalization`) this option alone still depends on how a step is split.
    """

    weight: float | None = None
    options: dict = field(default_factory=dict)
    rescale_to_ce: bool = False


class ObjectiveConfigError(ValueError):
    """Problems of an objective's config, each `path.to.key: what is wrong`, the path from `root` (the
    config's own name: "objective", or a recipe's "loss.objective")."""

    def __init__(self, problems: list[str], root: str = "objective"):
        self.problems, self.root = list(problems), root
        # a problem of the config as a whole starts with ": " (no key of its own)
        super().__init__("; ".join(f"{root}{p}" if p.startswith(": ") else f"{root}.{p}" for p in self.problems))


@dataclass
class ObjectiveConfig:
    """The terms and their weights and options, checked when made (`numloss.losses.options`): unknown
    terms or options, weights that are not numbers (a string "3" too), non-finite or negative weights,
    option values the term cannot use (a scalar or zero `sigmas`, `tau <= 0`, a string where a number
    belongs, ...), two terms that each replace CE, are `ObjectiveConfigError`s (ValueErrors) naming each
    key's path. The rules are each term's registration's (`numloss.register_term`). `Objective` adds the
    vocabulary's checks (NTIL needs a digits vocabulary, DEL the ten digits and the decimal point)."""

    terms: dict[str, TermConfig] = field(default_factory=dict)
    z_loss: float = 0.0
    ignore_index: int = IGNORE_INDEX

    def __post_init__(self):
        for name, term in list(self.terms.items()):
            if name not in DEFAULT_WEIGHTS:
                raise ObjectiveConfigError([f"terms.{name}: unknown term; known terms: {sorted(registered_terms())}"
                                            " (a term of your own: numloss.register_term)"])
            spec = term_spec(name)
            if term is None:
                term = TermConfig()
            elif isinstance(term, (int, float)) and not isinstance(term, bool):
                term = TermConfig(weight=float(term))
            elif isinstance(term, dict):
                term = _term_from_dict(name, term)
            elif not isinstance(term, TermConfig):
                raise ObjectiveConfigError([f"terms.{name}: expected a weight (a number) or a mapping of weight and "
                                            f"options, got {term!r}"])
            if term.weight is None:
                term.weight = spec.default_weight
            problems = spec.config_problems(term.options, term.weight)
            if problems:
                raise ObjectiveConfigError(problems)
            self.terms[name] = term
        replacing = [name for name in self.terms if term_spec(name).replaces_ce]
        if len(replacing) > 1:
            raise ObjectiveConfigError([f"terms.{replacing[1]}: {replacing[0]} and {replacing[1]} each replace CE;"
                                        " an objective takes at most one of them"])
        for key, value in (("z_loss", self.z_loss),):
            problem = finite(0)(value)
            if problem:
                raise ObjectiveConfigError([f"{key}: {problem}"])

    @classmethod
    def from_dict(cls, config: dict, root: str = "objective") -> "ObjectiveConfig":
        """From a plain mapping, e.g. a recipe's YAML: `{"z_loss": 0, "terms": {"smmd": {"weight": 3,
        "sigmas": [2.0]}, "ntl_was": 0.3, "gce": {}}}`. Unknown keys are errors that name the key; every
        error names its path from `root` (a recipe passes "loss.objective")."""
        if not isinstance(config, dict):
            raise ObjectiveConfigError([f": expected a mapping, got {config!r}"], root)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ObjectiveConfigError([f"{unknown[0]}: unknown key; expected {sorted(known)}"], root)
        terms = config.get("terms") or {}
        if not isinstance(terms, dict):
            raise ObjectiveConfigError([f"terms: expected a mapping of term names, got {terms!r}"], root)
        try:
            return cls(**{**config, "terms": dict(terms)})
        except ObjectiveConfigError as err:
            raise ObjectiveConfigError(err.problems, root) from None


def _term_from_dict(name: str, spec: dict) -> TermConfig:
    spec = dict(spec)
    weight = spec.pop("weight", None)
    rescale = spec.pop("rescale_to_ce", False)
    options = spec.pop("options", {})
    if weight is not None and not (isinstance(weight, (int, float)) and not isinstance(weight, bool)):
        raise ObjectiveConfigError([f"terms.{name}.weight: expected a number, got {weight!r}"])
    if not isinstance(rescale, bool):
        raise ObjectiveConfigError([f"terms.{name}.rescale_to_ce: expected true/false, got {rescale!r}"])
    if not isinstance(options, dict):
        raise ObjectiveConfigError([f"terms.{name}.options: expected a mapping, got {options!r}"])
    options = {**options, **spec}  # options may be given flat or under "options"
    return TermConfig(weight=None if weight is None else float(weight), options=options, rescale_to_ce=rescale)


@dataclass
class ObjectiveOutput:
    loss: torch.Tensor  # the total to backpropagate
    ce: torch.Tensor  # CE (plus the z-loss if configured)
    terms: dict[str, torch.Tensor]  # each term's unweighted value
    numeric_positions: int
    # with diagnostics: this batch's gradient sums (`numloss.diagnostics`), 0-d float64 tensors; else None
    grad_sums: dict[str, torch.Tensor] | None = None

    def log_dict(self) -> dict[str, float]:
        """Plain floats for logging: loss, ce, each term as `term/<name>`, and with diagnostics the
        gradient sums `grad_sums/...` (they add over micro-batches and ranks; `numloss.diagnostics.finalize`)."""
        out = {"loss": float(self.loss.detach()), "ce": float(self.ce.detach()), "numeric_positions": self.numeric_positions}
        out.update({f"term/{k}": float(v.detach()) for k, v in self.terms.items()})
        out.update({k: float(v) for k, v in (self.grad_sums or {}).items()})
        return out


def _rescaled(value: torch.Tensor, ce: torch.Tensor) -> torch.Tensor:
    """`stopgrad(CE / value) · value`: the value of CE, the gradient direction of `value`.

    A term that is 0 (no numeric position) stays exactly 0: CE / 0 would be inf, and 0 · inf is NaN.
    """
    scale = torch.where(value.detach() > 0, ce.detach() / value.detach(), torch.ones_like(value))
    return value * scale


class Objective:
    """`Objective(vocab, config)(logits, labels, group=None, vocab_start=0, *, counts=None,
    sequence_ids=None) -> ObjectiveOutput`.

    Parallel contract: as `numloss.functional` (with a TP group the logits are the local vocab shard
    and the output is identical on every rank). With `counts` (the optimizer step's, summed over
    micro-batches and data-parallel ranks by `numloss.normalization.reduce_counts`) the output is this
    micro-batch's share of the step's loss. `from_stats` takes a precomputed `LogitStats`, which is
    how the chunked head drives the same math.
    """

    def __init__(self, vocab: NumericVocab, config: ObjectiveConfig | dict | None = None, *,
                 diagnostics: bool = False, fused: bool | None = None):
        """`diagnostics`: compute the per-part gradient sums (`numloss.diagnostics`) on every call unless
        a call says otherwise (its `diagnostics=` argument). `fused`: the pass over the logits as Triton
        kernels (`numloss.fused_pass`); None: on CUDA when triton imports, unless NUMLOSS_FUSED=0."""
        if config is None:
            config = ObjectiveConfig()
        elif isinstance(config, dict):
            config = ObjectiveConfig.from_dict(config)
        problems = [p for name, term in config.terms.items() for p in term_spec(name).vocab_problems(vocab, term.options)]
        if problems:
            raise ValueError("objective: " + "; ".join(problems))
        self.vocab = vocab
        self.config = config
        self.diagnostics = diagnostics
        self.fused = fused

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, group=None, vocab_start: int = 0, *,
                 counts: LossCounts | None = None, sequence_ids: torch.Tensor | None = None,
                 diagnostics: bool | None = None, grad_in_place: bool = False,
                 sequence_split: SequenceSplit | None = None) -> ObjectiveOutput:
        """`counts`: the step's denominators (see `numloss.normalization`); None: this batch's own.
        `grad_in_place=True`: the logits are dead after this loss, and the caller must not read them again:
        on the fused path backward writes their gradient into their storage (no second [T, V] buffer;
        `compute_logit_stats`).
        `sequence_ids` (labels-shaped): which example each position belongs to in packed rows (NTIL
        averages over examples); None: each row is one sequence. `diagnostics`: also return the
        gradient sums of `numloss.diagnostics` in `out.grad_sums` (None: the objective's default).
        `sequence_split` (`numloss.sequence_split.SequenceSplit`): the rows are split along the sequence
        over ranks and `logits`, `labels` are this rank's positions (`split.local(whole labels)`); the
        output is this rank's share of the whole rows' loss (with `counts=`, of the step's), and the
        split's whole-row `sequence_ids` replace the argument."""
        diagnosing = self._diagnosing(diagnostics)  # they read the logits in forward: in place is safe
        stats = compute_logit_stats(logits, labels, self.vocab, group, vocab_start, self.config.ignore_index,
                                    numeric=bool(self.config.terms), fused=self.fused, grad_in_place=grad_in_place)
        probe = None
        if diagnosing:
            probe = stats if self.config.terms else with_numeric_block(
                stats, labels, self.vocab, logits.shape[-1], group, vocab_start, self.config.ignore_index,
                lambda rows, cols: logits.detach().reshape(-1, logits.shape[-1])[rows[:, None], cols[None, :]])
        return self._output(stats, counts, sequence_ids, probe, sequence_split)

    def from_hidden(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, group=None,
                    vocab_start: int = 0, chunk_size: int = DEFAULT_CHUNK_SIZE, *,
                    counts: LossCounts | None = None, sequence_ids: torch.Tensor | None = None,
                    diagnostics: bool | None = None, logit_transform=None,
                    sequence_split: SequenceSplit | None = None) -> ObjectiveOutput:
        """The same objective from hidden states [..., H] and the lm_head weight (its vocab shard under
        TP), with logits computed one vocabulary chunk at a time and never for the whole vocabulary at once
        (`numloss.chunked_head`): a chunk holds at most `chunk_size` tokens' worth of logits. Same
        collectives as the logits path, plus d hidden's all-reduce in backward under TP.
        `logit_transform`: the model's logit scale / soft cap (`numloss.logit_transform.LogitTransform`)."""
        stats = chunked_logit_stats(hidden, weight, labels, self.vocab, group, vocab_start,
                                    self.config.ignore_index, numeric=bool(self.config.terms), chunk_size=chunk_size,
                                    fused=self.fused, logit_transform=logit_transform)
        probe = None
        if self._diagnosing(diagnostics):
            flat = hidden.detach().reshape(-1, hidden.shape[-1])

            def block(rows, cols):
                x = flat[rows] @ weight.detach()[cols].t()
                return x if logit_transform is None else logit_transform.apply(x).to(x.dtype)

            probe = stats if self.config.terms else with_numeric_block(
                stats, labels, self.vocab, weight.shape[0], group, vocab_start, self.config.ignore_index, block)
        return self._output(stats, counts, sequence_ids, probe, sequence_split)

    @property
    def replaces_ce(self) -> str | None:
        """The configured term that replaces CE (GCE), or None."""
        return next((name for name in self.config.terms if term_spec(name).replaces_ce), None)

    def denominator_keys(self) -> dict[str, str]:
        """{"ce": key, term: key, ...}: which count (`numloss.normalization`) each part divides by."""
        keys = {"ce": TOKENS}
        keys.update({name: term_spec(name).denominator(term.options) for name, term in self.config.terms.items()})
        return keys

    def counts(self, labels: torch.Tensor, sequence_ids: torch.Tensor | None = None, *,
               sequence_split: SequenceSplit | None = None) -> LossCounts:
        """This batch's denominators, from its labels alone (aligned with the logits: shifted for a
        causal LM). Sum them over a step's micro-batches and data-parallel ranks with
        `numloss.normalization.reduce_counts` and pass the total as `counts=`. With `sequence_split`,
        `labels` are this rank's positions and the counts its share (`numloss.sequence_split.split_counts`):
        sum them over the data-parallel AND the split's ranks."""
        weights = {key: self.config.terms[name].options["position_weights"]
                   for name, key in self.denominator_keys().items() if key.endswith(".position_weights")}
        if sequence_split is not None:
            if sequence_ids is not None:
                raise ValueError("counts: with a sequence_split the split carries the whole rows' sequence_ids")
            view = sequence_split.view(self.vocab, self.config.ignore_index)
            return split_counts(view, set(self.denominator_keys().values()), labels, weights)
        return batch_counts(labels, self.vocab, set(self.denominator_keys().values()), self.config.ignore_index,
                            sequence_ids=sequence_ids, position_weights=weights)

    def from_stats(self, stats: LogitStats, counts: LossCounts | None = None,
                   sequence_ids: torch.Tensor | None = None, *, diagnostics: bool | None = None,
                   sequence_split: SequenceSplit | None = None) -> ObjectiveOutput:
        """The objective from precomputed stats. Its diagnostics see the numeric rows `stats` holds (none
        for stats computed with `numeric=False`: then CE's norm is 0)."""
        return self._output(stats, counts, sequence_ids, stats if self._diagnosing(diagnostics) else None,
                            sequence_split)

    def _diagnosing(self, diagnostics: bool | None) -> bool:
        return self.diagnostics if diagnostics is None else bool(diagnostics)

    def _split_problems(self, sequence_ids) -> list[str]:
        problems = [f"terms.{name}: not registered as exact under a sequence split (register_term(..., splits=True)"
                    " once it sums per-position values and reads the rows' structure through stats.runs)"
                    for name in self.config.terms if not term_spec(name).splits]
        problems += [f"terms.{name}.rescale_to_ce: a ratio of this rank's own CE and term, which differs by rank"
                     " under a sequence split" for name, term in self.config.terms.items() if term.rescale_to_ce]
        if sequence_ids is not None:
            problems.append("sequence_ids: with a sequence_split the split carries the whole rows' sequence_ids")
        return problems

    def _with_split(self, stats: LogitStats, probe: LogitStats | None, counts: LossCounts | None,
                    sequence_ids, split: SequenceSplit):
        """(stats, probe, counts, sequence_ids) for this rank's positions of split rows: the stats carry the
        whole rows' label structure; no counts means the whole rows' own (no collective)."""
        problems = self._split_problems(sequence_ids)
        if problems:
            raise ObjectiveConfigError(problems)
        view = split.view(self.vocab, self.config.ignore_index)
        view.check_local(stats.labels.view(stats.shape))
        if counts is None:
            counts = whole_counts(view, set(self.denominator_keys().values()))
        stats, probe = (None if s is None else replace_split(s, view) for s in (stats, probe))
        local_ids = None if split.sequence_ids is None else split.local(split.sequence_ids)
        return stats, probe, counts, local_ids

    def _output(self, stats: LogitStats, counts: LossCounts | None, sequence_ids: torch.Tensor | None,
                probe: LogitStats | None, sequence_split: SequenceSplit | None = None) -> ObjectiveOutput:
        if sequence_split is not None:
            stats, probe, counts, sequence_ids = self._with_split(stats, probe, counts, sequence_ids, sequence_split)
        # The diagnostics run first, and leave every random generator as they found it: NTIL's Gumbel
        # noise is then drawn by the training terms below exactly as without them, and is the same noise
        # the diagnostics saw (`numloss.diagnostics`).
        sums = None if probe is None else gradient_sums(self, probe, counts, sequence_ids)
        ce, values, parts = self.parts(stats, counts, sequence_ids)
        pieces = iter(parts.values())
        total = next(pieces)
        for piece in pieces:
            total = total + piece
        if "z_loss" in parts:
            ce = ce + parts["z_loss"]
        return ObjectiveOutput(loss=total, ce=ce, terms=values, numeric_positions=stats.numeric.count, grad_sums=sums)

    def parts(self, stats: LogitStats, counts: LossCounts | None = None,
              sequence_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(CE, each term's unweighted value, the parts of the total): the parts are what the total adds
        up, in its order of summation: "ce" (CE, or (1 - w)·CE beside GCE), "gce" (w·GCE; so is any term
        that replaces CE), every other term's w·term (`stopgrad(CE / term)·w·term` with `rescale_to_ce`),
        and "z_loss" when configured. `numloss.diagnostics` takes the gradient of each part."""
        keys = self.denominator_keys()

        def per_batch(name: str) -> dict:
            """The term's per-batch arguments: its step denominator, and packed sequence ids."""
            extra = {} if counts is None else {"denominator": counts.denominator(keys[name])}
            if sequence_ids is not None and term_spec(name).takes_sequence_ids:
                extra["sequence_ids"] = sequence_ids
            return extra

        ce_denominator = None if counts is None else counts.denominator(keys["ce"])
        ce = cross_entropy_term(stats, self.vocab, denominator=ce_denominator)
        terms = self.config.terms
        values = {name: term_spec(name).fn(stats, self.vocab, **term.options, **per_batch(name))
                  for name, term in terms.items()}
        scaled = {name: _rescaled(values[name], ce) if term.rescale_to_ce else values[name]
                  for name, term in terms.items()}
        # A term that replaces CE (GCE): (1 - w)·CE + w·term, exactly CE at w = 0 and exactly the term at w = 1.
        replacing = self.replaces_ce
        parts = {"ce": ce} if replacing is None else {"ce": (1 - terms[replacing].weight) * ce,
                                                      replacing: terms[replacing].weight * scaled[replacing]}
        for name, term in terms.items():
            if name != replacing:
                parts[name] = term.weight * scaled[name]
        if self.config.z_loss:  # a penalty on the normaliser, kept whether CE or GCE scores the tokens
            parts["z_loss"] = z_loss_term(stats, self.config.z_loss, ce_denominator)
        return ce, values, parts
