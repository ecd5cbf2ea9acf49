"""A generator for DeepMind-Math-style arithmetic, so arithmetic data exists offline.

Modules: "add_or_sub", "mul", "div", "mixed" (or "all": the four in turn). Every record `i` is drawn
from its own `random.Random(f"{seed}:{module}:{i}")` (string seeds are hashed with SHA-512, so
this does not depend on PYTHONHASHSEED or on which worker draws it): the same options give the same
problems in any order, in any process.

Difficulty knobs:
- `min_digits`, `max_digits`: size of each operand (integer part).
- `terms`: number of operands for add_or_sub (2 = "a + b").
- `negatives`: allow negative operands.
- `decimals`: digits after the point for add_or_sub/mul operands (0 = integers).
- `mixed_ops`: number of operators in a "mixed" expression (exact division only, integer result).
Division is exact by construction (the dividend is quotient x divisor), as in DeepMind's `div`.
"""

from __future__ import annotations

import random
from fractions import Fraction

from .base import Example, Source

MODULES = ("add_or_sub", "mul", "div", "mixed")


def _operand(rng: random.Random, o: dict, decimals: int = 0) -> Fraction:
    digits = rng.randint(o["min_digits"], o["max_digits"])
    lo = 0 if digits == 1 else 10 ** (digits - 1)
    value = Fraction(rng.randint(lo, 10**digits - 1))
    if decimals:
        value += Fraction(rng.randint(0, 10**decimals - 1), 10**decimals)
    if o["negatives"] and rng.random() < 0.3:
        value = -value
    return value


def _fmt(x: Fraction) -> str:
    if x.denominator == 1:
        return str(x.numerator)
    # Decimal operands have power-of-ten denominators: print them exactly.
    text = f"{float(x):.12f}".rstrip("0").rstrip(".")
    return text


def _paren(x: Fraction) -> str:
    return f"({_fmt(x)})" if x < 0 else _fmt(x)


def generate(module: str, index: int, o: dict) -> tuple[str, str]:
    """(question, answer) for record `index` of `module`."""
    rng = random.Random(f"{o['seed']}:{module}:{index}")
    if module == "add_or_sub":
        terms = [_operand(rng, o, o["decimals"]) for _ in range(o["terms"])]
        expr, total = _fmt(terms[0]), terms[0]
        for t in terms[1:]:
            if rng.random() < 0.5:
                expr, total = f"{expr} + {_paren(t)}", total + t
            else:
                expr, total = f"{expr} - {_paren(t)}", total - t
        question = rng.choice(["What is {}?", "Calculate {}.", "Evaluate {}."]).format(expr)
        return question, _fmt(total)
    if module == "mul":
        a, b = _operand(rng, o, o["decimals"]), _operand(rng, o, o["decimals"])
        question = rng.choice(["What is {} times {}?", "Multiply {} and {}.", "Calculate {}*{}."])
        return question.format(_fmt(a), _paren(b)), _fmt(a * b)
    if module == "div":
        b = _operand(rng, o) or Fraction(1)
        q = _operand(rng, o)
        question = rng.choice(["What is {} divided by {}?", "Divide {} by {}.", "Calculate {}/{}."])
        return question.format(_fmt(q * b), _paren(b)), _fmt(q)
    if module == "mixed":
        return _mixed(rng, o)
    raise ValueError(f"arithmetic: unknown module {module!r}; expected one of {MODULES} or 'all'")


def _mixed(rng: random.Random, o: dict) -> tuple[str, str]:
    # Build left to right, keeping the value exact; a division only when it divides exactly.
    value = _operand(rng, o)
    expr, compound = _paren(value), False
    for _ in range(o["mixed_ops"]):
        left = f"({expr})" if compound else expr
        compound = True
        op = rng.choice("+-*/")
        if op == "/":
            divisors = [d for d in range(2, 13) if value.denominator == 1 and value.numerator % d == 0]
            if not divisors:
                op = "*"
            else:
                d = Fraction(rng.choice(divisors))
                expr, value = f"{left}/{_fmt(d)}", value / d
                continue
        t = _operand(rng, o)
        if op == "*":
            expr, value = f"{left}*{_paren(t)}", value * t
        elif op == "+":
            expr, value = f"{expr} + {_paren(t)}", value + t
        else:
            expr, value = f"{expr} - {_paren(t)}", value - t
    return f"Calculate {expr}.", _fmt(value)


class Arithmetic(Source):
    kind = "arithmetic"
    defaults = {"module": "all", "n": 1000, "seed": 0, "min_digits": 1, "max_digits": 3,
                "terms": 2, "negatives": True, "decimals": 0, "mixed_ops": 2}

    def _iter_raw(self):
        module = self.opts["module"]
        if module != "all" and module not in MODULES:
            raise ValueError(f"arithmetic: unknown module {module!r}; expected one of {MODULES} or 'all'")
        for i in range(int(self.opts["n"])):
            m = MODULES[i % len(MODULES)] if module == "all" else module
            yield f"arithmetic/{m}#{i}", (m, i)

    def fingerprint(self):
        return {"kind": self.kind, "options": self.opts, "limit": self.cfg.limit, "generator": 1}

    def to_example(self, raw, ref):
        module, index = raw
        question, answer = generate(module, index, self.opts)
        return self.finish(Example(prompt=question, target=answer, answer=float(Fraction(answer)),
                                   answer_text=answer))


