"""The term registry: the one door through which every term, built in or a user's, reaches the objective.

    numloss.register_term("my_term", my_term, default_weight=0.1, needs=("digits",),
                          options={"scale": numloss.losses.options.finite(0, strict=True)})

after which `Objective(vocab, {"terms": {"my_term": {}}})`, `ObjectiveConfig.from_dict` and a recipe's
`loss.objective.terms` treat "my_term" as they treat "smmd": the same config forms, the same checks of
weights and options, the same normalisation over a step, the same dense, vocab-parallel, chunked-head
and fused paths, and the same per-term gradient diagnostics.

The term function: `fn(stats, vocab, *, <options with defaults>, denominator=None[, sequence_ids=None])
-> 0-d tensor`, written against `numloss.logit_stats.LogitStats`:
- `stats.numeric.logits` [M, N] fp32: the numeric columns at the M numeric positions, the same on every
  tensor-parallel rank (so a term never communicates: its gradient flows back through the pass that
  gathered them); `stats.numeric.target` [M] the target's numeric column; `stats.numeric.rows` [M] the
  positions in the flattened labels.
- the labels' structure: `stats.labels`, `stats.valid`, `stats.is_numeric` [T] and `stats.shape` (the
  last dimension is the sequence), and `stats.runs` (maximal runs of numeric labels within a sequence,
  each position's place in its run). A term may derive its own runs from these (DEL's digit-and-point runs).
- with the need "full_vocab": `stats.numeric.lse` [M] (and `stats.lse`, `stats.ce_per_token` [T]), the
  full-vocabulary log-sum-exp.
- `denominator`: the step's count of the term's kind (`denominator=` below; `numloss.normalization`),
  None for the batch's own; the term returns its sum divided by it, so it is layout-invariant.
- `sequence_ids` (only if the function takes it): packed rows' example ids, labels-shaped, or None.
Every other parameter is an option a config may set; it must have a default.

`needs` (names from `NEEDS`; or a function of the term's options, defaults filled in, that returns them)
declares what costs or constrains, so the rest of numloss can act on it before any logit is read:
- "full_vocab": the term reads the full-vocabulary log-sum-exp. `numloss.functional` then makes a pass over
  the whole vocabulary for it; without it, the functional form reads only the [M, N] numeric block
  (one collective under TP).
- "digits": the vocabulary's values are all digits 0..9 (NTIL).
- "ten_digits": exactly ten numeric tokens, the digits 0..9 each once (DEL's ten digit logits).
- "decimal_point": the vocabulary knows the decimal point's token id (`NumericVocab.decimal_point_id`,
  which `NumericVocab.from_tokenizer` finds).
The vocabulary needs are checked when an `Objective` is built from a config and a vocabulary (before
any model exists), each failure an error naming the term and the need.

`denominator` ("numeric" by default; or a function of the options): which step count the term divides
by: "tokens", "numeric", "place_value", "sequences" (`numloss.normalization`), or
"<name>.position_weights" (the sum of the term's own `position_weights` option at numeric positions).

`replaces_ce=True` (GCE): the term scores every valid token itself and the total is
`(1 - w)·CE + w·term`, its weight in [0, 1]; at most one such term per objective.

`splits=True`: the term is exact on rows split along the sequence over ranks (`numloss.sequence_split`):
it is a sum of per-position values of its own positions' statistics divided by its denominator, and reads
the rows' structure only through `stats.runs` (under a split, this rank's positions with their places in
the whole rows' runs) or `stats.split`. The objective refuses a split for a term registered without it.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping

from ..normalization import NUMERIC, PLACE_VALUE, SEQUENCES, TOKENS
from ..vocab import NumericVocab
from .options import DEFAULT_WEIGHT_RULE, finite

Rule = Callable[[Any], "str | None"]

NEEDS = {
    "full_vocab": "the full-vocabulary log-sum-exp",
    "digits": "a digits vocabulary (every numeric value one of the digits 0..9; numeric policy digits)",
    "ten_digits": "exactly the ten digit tokens 0..9, one column each (numeric policy digits, no space variants)",
    "decimal_point": "the decimal point's token id (NumericVocab.from_tokenizer finds '.'; or the term's "
                     "decimal_point_id option)",
}
COUNTS = (TOKENS, NUMERIC, PLACE_VALUE, SEQUENCES)
# Arguments the objective passes with each batch, never from a config.
PER_BATCH = ("denominator", "sequence_ids")
# Names a term cannot take: the objective's own parts and log keys.
RESERVED = frozenset({"ce", "z_loss", "loss"})
_NAME = re.compile(r"[a-z][a-z0-9_]*")
_MISSING = object()


@dataclass(frozen=True)
class TermSpec:
    """A registered term (see the module docstring). Built by `register_term`, never by hand."""

    name: str
    fn: Callable
    default_weight: float
    needs_fn: Callable[[Mapping], Iterable[str]]
    denominator_fn: Callable[[Mapping], str]
    option_rules: Mapping[str, Rule]
    replaces_ce: bool
    defaults: Mapping[str, Any]  # every option and its default, from the function's signature
    takes_sequence_ids: bool
    builtin: bool
    splits: bool = False  # exact on rows split along the sequence (module docstring)

    @property
    def option_names(self) -> list[str]:
        return sorted(self.defaults)

    def with_defaults(self, options: Mapping) -> dict:
        return {**self.defaults, **options}

    def needs(self, options: Mapping | None = None) -> frozenset[str]:
        """What the term needs with these options (`NEEDS` names)."""
        needs = frozenset(self.needs_fn(self.with_defaults(options or {})))
        unknown = sorted(needs - set(NEEDS))
        if unknown:
            raise ValueError(f"term {self.name!r}: needs {unknown} unknown; known needs: {sorted(NEEDS)}")
        return needs

    def denominator(self, options: Mapping | None = None) -> str:
        """The count key (`numloss.normalization`) the term divides by with these options."""
        key = self.denominator_fn(self.with_defaults(options or {}))
        allowed = (*COUNTS, f"{self.name}.position_weights")
        if key not in allowed:
            raise ValueError(f"term {self.name!r}: denominator {key!r} is not a count; expected one of {list(allowed)}")
        return key

    def weight_rule(self) -> Rule:
        return finite(0, maximum=1) if self.replaces_ce else DEFAULT_WEIGHT_RULE

    def config_problems(self, options: Mapping, weight: float | None) -> list[str]:
        """Every problem of a weight and options for this term, each `terms.<name>.<key>: problem`."""
        problems = [f"terms.{self.name}.{key}: no such option of {self.name}; options: {self.option_names}"
                    for key in sorted(set(options) - set(self.defaults))]
        if weight is not None:
            problem = self.weight_rule()(weight)
            if problem:
                problems.append(f"terms.{self.name}.weight: {problem}")
        for key, value in options.items():
            rule = self.option_rules.get(key)
            problem = rule(value) if rule is not None else None
            if problem:
                problems.append(f"terms.{self.name}.{key}: {problem}")
        return problems

    def vocab_problems(self, vocab: NumericVocab, options: Mapping | None = None) -> list[str]:
        """What `vocab` lacks of this term's needs (empty: it has all)."""
        problems = []
        for need in sorted(self.needs(options)):
            if need == "digits" and not vocab.is_digits():
                problems.append(f"term {self.name!r} needs {NEEDS[need]}; {vocab!r} is not one")
            elif need == "ten_digits" and not vocab.is_ten_digits():
                problems.append(f"term {self.name!r} needs {NEEDS[need]}; {vocab!r} is not that")
            elif need == "decimal_point" and vocab.decimal_point_id is None:
                problems.append(f"term {self.name!r} needs {NEEDS[need]}; {vocab!r} has none")
        return problems


_SPECS: dict[str, TermSpec] = {}
_FUNCTIONS: dict[str, Callable] = {}
_WEIGHTS: dict[str, float] = {}
# Read-only views: a term enters them through `register_term` only.
TERMS: Mapping[str, Callable] = MappingProxyType(_FUNCTIONS)
DEFAULT_WEIGHTS: Mapping[str, float] = MappingProxyType(_WEIGHTS)


def _as_function(value, check: Callable[[Any], None]) -> Callable[[Mapping], Any]:
    """A constant (checked by `check`) or a function of the options, as a function of the options."""
    if callable(value):
        return value
    check(value)
    return lambda options: value


def register_term(name: str, fn: Callable, *, default_weight: float = _MISSING, needs=(), denominator=NUMERIC,
                  options: Mapping[str, Rule] | None = None, replaces_ce: bool = False, splits: bool = False,
                  _builtin: bool = False) -> TermSpec:
    """Register the term `name` (see the module docstring for `fn`'s contract and each argument).

    `default_weight` (required): the weight a config that lists the term without one gives it.
    `splits`: exact under a sequence split (module docstring). `needs`: `NEEDS` names, or a function of the options returning them. `denominator`: a count key, or
    a function of the options returning one. `options`: a rule per option, `rule(value) -> None` when
    fine or a message (`numloss.losses.options` has `finite`, `choice`, `boolean`, `positive_list`);
    options without a rule take any value. A bad registration (a name taken or reserved, no default
    weight, a function whose signature does not fit, an unknown need or count) is a ValueError naming
    the term and what is wrong, and registers nothing. Returns the `TermSpec`."""
    where = f"register_term({name!r})"
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"{where}: a term's name is lower-case letters, digits and '_', starting with a letter"
                         " (it is a config key and a log key)")
    if name in RESERVED:
        raise ValueError(f"{where}: {name!r} is reserved (the objective's own parts: {sorted(RESERVED)})")
    if name in _SPECS:
        owner = _SPECS[name].fn
        raise ValueError(f"{where}: a term {name!r} is already registered ({owner.__module__}.{owner.__qualname__});"
                         " choose another name, or unregister_term it first")
    if default_weight is _MISSING:
        raise ValueError(f"{where}: default_weight is required (the weight a config gives the term when it names"
                         " none)")
    if not callable(fn):
        raise ValueError(f"{where}: fn must be callable, got {fn!r}")
    defaults, takes_sequence_ids = _signature_problems(where, fn)
    rules = dict(options or {})
    unknown = sorted(set(rules) - set(defaults))
    if unknown:
        raise ValueError(f"{where}: option rules for {unknown}, which {fn.__qualname__} does not take;"
                         f" its options: {sorted(defaults)}")
    bad = sorted(key for key, rule in rules.items() if not callable(rule))
    if bad:
        raise ValueError(f"{where}: the rule of option {bad[0]!r} must be a function value -> None or a message")

    def check_needs(value):
        if isinstance(value, str) or not all(isinstance(n, str) for n in value):
            raise ValueError(f"{where}: needs must be a collection of names from {sorted(NEEDS)} (or a function"
                             f" of the options returning one), got {value!r}")

    spec = TermSpec(
        name=name, fn=fn, default_weight=default_weight,
        needs_fn=_as_function(needs, check_needs),
        denominator_fn=_as_function(denominator, lambda value: None),  # checked below, as a function's
        option_rules=MappingProxyType(rules), replaces_ce=bool(replaces_ce), defaults=MappingProxyType(defaults),
        takes_sequence_ids=takes_sequence_ids, builtin=_builtin, splits=bool(splits))
    # The declarations must hold for the defaults before anything is registered.
    try:
        spec.needs()
        spec.denominator()
    except (ValueError, KeyError, TypeError) as err:  # a function of the options may fail on its defaults too
        raise ValueError(f"{where}: {err}") from None
    problem = spec.weight_rule()(default_weight)
    if problem:
        raise ValueError(f"{where}: default_weight {problem}")
    for key, rule in rules.items():
        problem = rule(defaults[key])
        if problem:
            raise ValueError(f"{where}: the default of option {key!r} breaks its own rule: {problem}")
    _SPECS[name] = spec
    _FUNCTIONS[name] = fn
    _WEIGHTS[name] = float(default_weight)
    return spec


def _signature_problems(where: str, fn: Callable) -> tuple[dict, bool]:
    """(option defaults, whether fn takes sequence_ids), or a ValueError saying how the signature
    departs from `fn(stats, vocab, *, <options with defaults>, denominator=None[, sequence_ids=None])`."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: cannot read the signature of {fn!r}: {err}") from None
    expected = "fn(stats, vocab, *, <options with defaults>, denominator=None[, sequence_ids=None])"
    variadic = [p.name for p in parameters if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if variadic:
        raise ValueError(f"{where}: {fn.__qualname__} takes *{variadic[0]}; options must be named parameters,"
                         f" so a config's unknown key can be refused: {expected}")
    if len(parameters) < 2 or any(p.kind == p.KEYWORD_ONLY or p.name in PER_BATCH for p in parameters[:2]):
        raise ValueError(f"{where}: {fn.__qualname__} must take (stats, vocab) as its first two parameters: {expected}")
    rest = parameters[2:]
    names = {p.name for p in rest}
    if "denominator" not in names:
        raise ValueError(f"{where}: {fn.__qualname__} must take `denominator` (the step's count, so the term is"
                         f" the same at any layout): {expected}")
    required = [p.name for p in rest if p.default is inspect.Parameter.empty]
    if required:
        raise ValueError(f"{where}: {fn.__qualname__}'s parameter {required[0]!r} has no default; every option"
                         f" needs one (a config may leave it out): {expected}")
    defaults = {p.name: p.default for p in rest if p.name not in PER_BATCH}
    return defaults, "sequence_ids" in names


def unregister_term(name: str) -> None:
    """Remove a term registered by `register_term` (not a built-in one)."""
    spec = term_spec(name)
    if spec.builtin:
        raise ValueError(f"unregister_term({name!r}): a built-in term cannot be removed")
    del _SPECS[name], _FUNCTIONS[name], _WEIGHTS[name]


def term_spec(name: str) -> TermSpec:
    """The registered term `name`; a KeyError naming the known terms otherwise."""
    try:
        return _SPECS[name]
    except KeyError:
        raise KeyError(f"unknown term {name!r}; known terms: {sorted(_SPECS)}") from None


def registered_terms() -> list[str]:
    """The registered terms' names, in registration order (built-ins first)."""
    return list(_SPECS)
