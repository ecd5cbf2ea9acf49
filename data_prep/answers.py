"""The one answer reader: the number a text gives as its answer, for gold answers and model outputs alike.

    parse_answer("The answer is 1,236.")            # 1236.0
    parse_answer("... = 130,000.\\n#### $130,000")   # 130000.0
    parse_answer("$\\boxed{\\frac{3}{4}}$")           # 0.75
    parse_answer("#### 18\\n\\nQuestion: ... 5 more")  # 18.0
    parse_answer("The answer is 48 + 24.")          # None: an expression, not a number
    read_answer("x = -2/3")                         # Reading(value=-0.666..., numeral='-2/3', rule='last line')

The data_prep sources read their gold answers with it and the evaluation reads the model's outputs with it,
so a perfect model is never marked wrong because the two sides read "1,200" differently.

Which number is the answer. The text is first cut where a run-on starts: at a line (not the first) that opens a
new turn ("Question:", "Q:", "Problem:", "Human:", "User:", "Instruction:", ...) and at an end-of-turn token
("<|im_end|>", "</s>", "<|eot_id|>", ...); what follows is the model going on past its answer. In what is left,
the first rule that applies decides:

1. "####": the first line that starts with "#### N" (N a number, after an optional sign or currency); the
   GSM8K format ends a solution there. A markdown header "#### Step 1" does not start with a number and is
   not an answer line.
2. "boxed": the last \\boxed{...} (or \\fbox{...}): its content.
3. "answer phrase": the last "answer is", "answer:", "answer =" ("The final answer is", "**Answer:**"): the
   rest of its line, or the next non-empty line when the rest has no digit.
4. "bare first line": the first line is one number and nothing else ("540" followed by run-on text).
5. "last line": the last line that has a digit.

Inside the chosen piece (rules 1-4) the text is split at "=" (and "≈"), and the last part that reads as one
number gives it ("The answer is 12 * 3 = 36 apples" -> 36; "x = -2/3" -> -2/3; "18 = 3 + 15" -> 18). A part
reads as one number when its first number is not an operand of an expression ("48 + 24", "4*sqrt(7)", a
list "2, 3", a time "3:45"); anything else after the number is trailing text (units, a period, "(because
...)"). In the last line (rule 5) the same holds for the part after the last "=" when the line has one;
without "=", its last number is the answer ("She sold 72 clips in April and May." -> 72), unless that number
is an operand of an expression.

What a number is: an optional sign (ASCII "-", "+", Unicode minus U+2212, an en dash right before a digit),
an optional currency sign ($, €, £, ¥, ₹), digits with optional thousands separators ("1,234,567"; also
thin and no-break spaces between digit groups, LaTeX "{,}" and "\\,"), an optional decimal part, then
optionally: a fraction "/d" ("3/4", "3 / 4"), a mixed number's fraction ("2 1/2"), an exponent ("3.2e5",
"1.2 \\times 10^{3}"), a scale word ("1.5 million"), "%" (ignored: "25%" is 25, as GSM8K writes percentages).
LaTeX \\frac, \\dfrac, \\tfrac, \\cfrac of two numbers are fractions ("1\\frac{1}{2}" is 1.5); \\text{...} and
\\mathrm{...} are their content; \\$ and \\% are $ and %; markdown "**" is dropped; GSM8K calculator
annotations "<<48/2=24>>" are dropped. Not read: number words ("five"), a decimal comma ("3,5"), space-grouped
thousands ("1 000"), an expression's value ("48 + 24" is not 72). A division by zero is no number.

Gold answers that are not one number (DeepMind-Math surds "-14 + 4*sqrt(7)", ChartQA's "Yes") read as None,
which is what the sources need to score those rows by their text. Numbers given as numbers (int/float, from a
JSON field) are taken as they are; booleans and non-finite values are no answer.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

__all__ = ["Reading", "parse_answer", "read_answer", "RULES"]

RULES = ("####", "boxed", "answer phrase", "bare first line", "last line", "number")


@dataclass(frozen=True)
class Reading:
    """An answer as read: its value, the numeral as it stood in the (normalised) text, and the rule that chose
    it (one of RULES; "number" for a value passed as a number)."""

    value: float
    numeral: str
    rule: str


# ---- normalisation -----------------------------------------------------------------------------------
_MINUS = {0x2212: "-", 0xFE63: "-", 0xFF0D: "-"}
_EN_DASH_SIGN = re.compile(r"(?<![\w)\]}])\u2013(?=\s?\d)")
_DIGIT_GAP = re.compile(r"(?<=\d)(?:[\u2009\u202f\u00a0]|\\,|\\!|\{,\})(?=\d{3}(?!\d))")
_CALCULATOR = re.compile(r"<<[^<>]*>>")
# markdown bold ("**Answer:** 18"), not Python's power ("x**2"): the markers sit at word boundaries
_BOLD = re.compile(r"(?<![\w)*])\*\*(?=\S)([^*\n]+?)(?<=\S)\*\*(?![\w(*])")
_TEXT_CMD = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_FRAC = re.compile(r"\\[dtc]?frac\s*(?:\{([^{}]*)\}|(\d))\s*(?:\{([^{}]*)\}|(\d))")
_PLAIN_NUMBER = re.compile(r"^\s*([-+]?)\s*(\d+(?:\.\d+)?|\.\d+)\s*$")
_LATEX_SPACES = re.compile(r"\\(?:left|right|displaystyle|[;:!,]|quad|qquad)(?![a-zA-Z])")
_DELIMS = re.compile(r"\\[()\[\]]")
# A piece of LaTeX that is no number (\frac{\pi}{2}): it stands in the text as an operand, so a number beside
# it is part of an expression.
_NON_NUMBER = "\u2047"


def _frac(match: re.Match, text: str) -> str:
    num = match.group(1) if match.group(1) is not None else match.group(2)
    den = match.group(3) if match.group(3) is not None else match.group(4)
    a, b = _PLAIN_NUMBER.match(num or ""), _PLAIN_NUMBER.match(den or "")
    if not (a and b):
        return f" {_NON_NUMBER} "
    n = Fraction(a.group(2)) * (-1 if a.group(1) == "-" else 1)
    d = Fraction(b.group(2)) * (-1 if b.group(1) == "-" else 1)
    if d == 0:
        return f" {_NON_NUMBER} "
    value = n / d
    # beside a whole number ("1\frac{1}{2}") it is a mixed number's fraction: keep a space between them
    lead = " " if match.start() > 0 and text[match.start() - 1].isdigit() else ""
    return f"{lead}{'-' if value < 0 else ''}{abs(value.numerator)}/{value.denominator}"


def normalize(text: str) -> str:
    """The text with the spellings above reduced to plain ones (signs, LaTeX, separators, markdown)."""
    t = text.translate(_MINUS)
    t = _EN_DASH_SIGN.sub("-", t)
    t = _CALCULATOR.sub("", t)
    t = _BOLD.sub(lambda m: m.group(1), t)
    t = t.replace("\\$", "$").replace("\\%", "%")
    t = _DIGIT_GAP.sub("", t)
    t = t.replace("{,}", ",")
    for _ in range(3):  # \text{...} inside \boxed{...}; a few levels are plenty
        new = _TEXT_CMD.sub(lambda m: m.group(1), t)
        if new == t:
            break
        t = new
    t = _FRAC.sub(lambda m: _frac(m, t), t)
    t = _LATEX_SPACES.sub(" ", t)
    t = _DELIMS.sub(" ", t)
    return t


# ---- numbers -----------------------------------------------------------------------------------------
_NUMERAL = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+"
_NUMBER = re.compile(
    rf"""
    (?P<sign>(?<![\w)\]}}.])[-+]\s?)?
    (?:(?P<cur>[$€£¥₹]\s?)(?P<sign2>[-+])?)?                 # -$5, $-5
    (?<![\w.])(?P<whole>{_NUMERAL})
    (?:
        \s*/\s*(?P<den>\d+(?:\.\d+)?)(?![\d.]*\s*/)             # 3/4, 3 / 4 (not a date 1/2/2020)
      | [ \t]+(?P<mnum>\d+)/(?P<mden>\d+)(?!\d)                  # 2 1/2
    )?
    (?P<exp>
        [eE](?P<e1>[-+]?\d+)(?![\w.])
      | \s*(?:\\times|\\cdot|×|·|\*|x)\s*10\s*\^\s*[{{]?\s*(?P<e2>[-+]?\d+)\s*[}}]?
    )?
    (?P<scale>\s+(?:thousand|million|billion|trillion)s?\b)?
    """,
    re.VERBOSE,
)
_SCALES = {"thousand": 10**3, "million": 10**6, "billion": 10**9, "trillion": 10**12}
# What makes a number an operand rather than the answer: an operator with an operand after it, a function
# before it, a neighbour in a list or a time.
_OPERAND_AFTER = re.compile(rf"^\s*(?:(?:\*\*|[-+*/^×÷·])\s*[\d(.\\a-zA-Z{_NON_NUMBER}√π]|\*?\s*(?:\\sqrt|sqrt|√|\\pi|π|{_NON_NUMBER})"
                            r"|,\s*[-+]?\d|:\d)")
_OPERAND_BEFORE = re.compile(rf"(?:[\d)]\s*[-+]\s*|[\w)]\s*(?:\*\*|[*/^×÷·])\s*|(?:\\sqrt|sqrt|√|\\log|log|ln|sin|cos|tan|exp|\^)\s*[({{]?\s*"
                             rf"|\d\s*,\s*|\d:|{_NON_NUMBER}\s*[-+*/^×÷·]?\s*)$")


def _value(m: re.Match) -> float | None:
    """The value of a match of _NUMBER, or None (a zero denominator, an overflow)."""
    whole = Fraction(m["whole"].replace(",", ""))
    if m["den"] is not None:
        den = Fraction(m["den"])
        if den == 0:
            return None
        whole = whole / den
    elif m["mnum"] is not None:
        den = int(m["mden"])
        if den == 0 or "." in m["whole"]:
            return None
        whole = whole + Fraction(int(m["mnum"]), den)
    exponent = m["e1"] or m["e2"]
    if exponent is not None:
        if abs(int(exponent)) > 300:
            return None
        whole = whole * Fraction(10) ** int(exponent)
    if m["scale"]:
        whole = whole * _SCALES[m["scale"].strip().lower().rstrip("s")]
    negative = "-" in ((m["sign"] or "") + (m["sign2"] or ""))
    value = float(-whole if negative else whole)
    return value if math.isfinite(value) else None


def _numbers(text: str) -> list[re.Match]:
    return [m for m in _NUMBER.finditer(text) if m["whole"]]


def _is_operand(text: str, m: re.Match) -> bool:
    before = text[:m.start()]
    binary_sign = m["sign"] is not None and re.search(r"[\d)]\s*$", before)  # "8 - 3": a subtraction
    return bool(binary_sign or _OPERAND_BEFORE.search(before) or _OPERAND_AFTER.match(text[m.end():]))


def _one_number(part: str) -> re.Match | None:
    """The part's first number when the part reads as one number (trailing words aside), else None."""
    found = _numbers(part)
    if not found or _is_operand(part, found[0]):
        return None
    return found[0]


def _read_piece(piece: str) -> re.Match | None:
    """Rules 1-4's reading of a piece: the last "="-separated part that reads as one number."""
    for part in reversed(re.split(r"=|≈", piece)):
        m = _one_number(part)
        if m is not None:
            return m
    return None


def _read_last_line(line: str) -> re.Match | None:
    """Rule 5's reading: after the last "=", the piece reading; else the line's last number, unless an operand."""
    if re.search(r"=|≈", line):
        return _one_number(re.split(r"=|≈", line)[-1])
    found = _numbers(line)
    if not found or _is_operand(line, found[-1]):
        return None
    return found[-1]


# ---- which number is the answer ----------------------------------------------------------------------
_RUN_ON = re.compile(
    r"(?im)^[ \t]*(?:question|q|problem|human|user|instruction|input)[ \t]*\d*[ \t]*:"
    r"|<\|im_end\|>|<\|im_start\|>|<\|eot_id\|>|<\|endoftext\|>|<\|end\|>|<\|user\|>|</s>")
_HASHES = re.compile(r"(?m)^[^\n]*?####[ \t]*([^\n]*)")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
_PHRASE = re.compile(r"(?i)\banswer\s*(?:is|was|would be|will be|[:=])\s*:?")
_BARE = re.compile(rf"^\s*{_NUMBER.pattern}\s*%?\s*\.?\s*$", re.VERBOSE)


def _cut_run_on(text: str) -> str:
    for m in _RUN_ON.finditer(text):
        if text[:m.start()].strip():
            return text[:m.start()]
    return text


def _boxed_contents(text: str) -> list[str]:
    out = []
    for m in _BOXED.finditer(text):
        i = m.end()
        if i < len(text) and text[i] == "{":
            depth, j = 0, i
            while j < len(text):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    break
                j += 1
            out.append(text[i + 1:j])
        else:  # \boxed 5
            token = re.match(r"\S*", text[i:]).group(0)
            out.append(token)
    return out


def _after_phrase(text: str, m: re.Match) -> str:
    rest = text[m.end():]
    line, _, below = rest.partition("\n")
    if re.search(r"\d", line):
        return line
    return next((ln for ln in below.split("\n") if ln.strip()), "")


def _reading(m: re.Match | None, rule: str) -> Reading | None:
    if m is None:
        return None
    value = _value(m)
    return None if value is None else Reading(value, m.group(0).strip(), rule)


def read_answer(text: Any) -> Reading | None:
    """The answer a text gives (see the module docstring for the rule), or None if it gives none."""
    if text is None or isinstance(text, bool):
        return None
    if isinstance(text, (int, float)):
        value = float(text)
        return Reading(value, repr(text), "number") if math.isfinite(value) else None
    region = _cut_run_on(normalize(str(text)))

    for m in _HASHES.finditer(region):
        piece = m.group(1)
        start = _NUMBER.match(piece.strip())
        if start and start["whole"]:
            return _reading(_read_piece(piece), "####")
    boxed = _boxed_contents(region)
    if boxed:
        return _reading(_read_piece(boxed[-1]), "boxed")
    phrases = list(_PHRASE.finditer(region))
    if phrases:
        return _reading(_read_piece(_after_phrase(region, phrases[-1])), "answer phrase")
    lines = [ln for ln in region.split("\n") if ln.strip()]
    if lines and _BARE.match(lines[0]):
        return _reading(_numbers(lines[0])[0], "bare first line")
    for line in reversed(lines):
        if re.search(r"\d", line):
            return _reading(_read_last_line(line), "last line")
    return None


def parse_answer(text: Any) -> float | None:
    """The answer's value (`read_answer(text).value`), or None when the text gives no number as its answer."""
    reading = read_answer(text)
    return None if reading is None else reading.value
