"""The objective against the numeric vocabulary, before any model is built: what each term's registered
needs (`numloss.register_term(..., needs=...)`; NTIL's digits, DEL's ten digits and decimal point, a
user's term's alike) ask of the recipe's numeric policy and of the model's tokenizer.

- `policy_problems`: from the recipe alone: a term that reads digits needs the digits policy, and one that
  reads the ten digit logits needs no space variants (a second token per digit). `recipes.experiments.study`
  plans its runs with it (a loss is left out for a tokenizer whose policy cannot serve it).
- `tokenizer_problems`: from the model's tokenizer (`recipes.checks.preflight`, on every rank before the
  engine is built): the numeric vocabulary the engine will build has what each term needs (numloss's
  `TermSpec.vocab_problems`: the ten digit tokens, the decimal point's token); a term that reads digits
  needs a tokenizer that writes each digit of a number as a token of its own (Llama-3's vocabulary holds
  the ten digits, so the digits policy finds them, but it writes numbers in tokens of up to three digits:
  the term would score almost no position); a term that needs the decimal point needs it as a token of
  its own between digits (a merged "5." or ".6" is not one). The engine's `Objective` checks the
  vocabulary too, but only once the model is built.
"""

from __future__ import annotations

from numloss import NumericVocab
from numloss.losses import term_spec

DIGIT_NEEDS = frozenset({"digits", "ten_digits"})
TOKENIZER_NEEDS = DIGIT_NEEDS | {"decimal_point"}
# more integer digits than any tokenizer puts in one token (Llama-3: three), then a decimal point and
# decimals; after a space, as numbers follow words in the data
NUMBER_PROBE = " 12345.678"


def policy_problems(objective, numeric_policy: str, space_variants: bool) -> list[str]:
    """The terms of `objective` (a `numloss.ObjectiveConfig`) whose registered needs this numeric policy
    cannot meet, each `loss.objective.terms.<name>: ...`."""
    problems = []
    for name, term in objective.terms.items():
        needs = term_spec(name).needs(term.options)
        where = f"loss.objective.terms.{name}: {name.upper()}"
        if needs & DIGIT_NEEDS and numeric_policy != "digits":
            problems.append(f"{where} needs loss.numeric_policy digits, got {numeric_policy!r}")
        elif "ten_digits" in needs and space_variants:
            problems.append(f"{where} needs the ten digit tokens alone; loss.space_variants adds a second token"
                            " per digit")
    return problems


def objective_problems(recipe) -> list[str]:
    """`policy_problems` of the recipe's objective and numeric vocabulary settings."""
    return policy_problems(recipe.loss.objective, recipe.loss.numeric_policy, recipe.loss.space_variants)


def tokenizer_needs(recipe) -> dict[str, frozenset]:
    """{term: what of TOKENIZER_NEEDS it needs} for the recipe's terms that need any of it."""
    found = {name: term_spec(name).needs(term.options) & TOKENIZER_NEEDS
             for name, term in recipe.loss.objective.terms.items()}
    return {name: needs for name, needs in found.items() if needs}


def tokenizer_problems(recipe, tokenizer) -> list[str]:
    """What the model's tokenizer (a Hugging Face tokenizer) lacks of the terms' needs (see the module
    docstring). Nothing is said here of what `objective_problems` refuses already."""
    needs = tokenizer_needs(recipe)
    if not needs or objective_problems(recipe):
        return []
    loss = recipe.loss
    try:
        vocab = NumericVocab.from_tokenizer(tokenizer, policy=loss.numeric_policy, max_value=loss.numeric_max_value,
                                            space_variants=loss.space_variants)
    except ValueError as err:
        return [f"loss.numeric_policy: {err}"]
    ids = tokenizer(NUMBER_PROBE, add_special_tokens=False)["input_ids"]
    pieces = [tokenizer.decode([i]) for i in ids]
    numeric = [p.strip() for p in pieces if any(c.isdigit() or c == "." for c in p)]
    digit_level = all(p == "." or (len(p) == 1 and p.isdigit()) for p in numeric)
    point_alone = any(p.strip() == "." and i == vocab.decimal_point_id for i, p in zip(ids, pieces))
    problems = []
    for name, term_needs in needs.items():
        where = f"loss.objective.terms.{name}: "
        found = [where + p for p in term_spec(name).vocab_problems(vocab, loss.objective.terms[name].options)]
        if term_needs & DIGIT_NEEDS and not digit_level:
            found.append(f"{where}{name.upper()} needs a tokenizer that writes each digit as a token of its own; "
                         f"this one writes {NUMBER_PROBE.strip()!r} as {numeric}: use a digit-level tokenizer "
                         "(Qwen2.5, SmolLM2, ...) or a term without this need")
        if "decimal_point" in term_needs and vocab.decimal_point_id is not None and not point_alone:
            found.append(f"{where}{name.upper()} needs the decimal point as a token of its own between digits; "
                         f"this tokenizer writes {NUMBER_PROBE.strip()!r} as {numeric}")
        problems += found
    return problems
