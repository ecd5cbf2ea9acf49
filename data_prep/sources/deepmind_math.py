"""DeepMind Mathematics, arithmetic modules: text files of alternating question / answer lines.

`path` is a .txt file, a directory of them (e.g. `train-easy/`) or a glob; `modules` filters the
file names (default: the arithmetic ones). Answers may be integers, decimals or fractions ("-2/3").

Answers that are not one number are kept by default: surds ("-14 + 4*sqrt(7)", "7*sqrt(17)/6") and
numerals in another base ("-191b", the answers of `add_or_sub_in_base`) make up about a tenth of the
arithmetic modules and are valid targets. Such a row has answer None and its answer text; evaluation
scores it by exact match of the text. The number spans of a surd are the numbers in it (-14, 4, 7);
a numeral in base N != 10 gets no number spans and no answer value (read as decimal, "10110" in
base 2 would be the number 10110), though its digit tokens are still numeric positions.
`require_answer=true` restores the strict behaviour: rows without a numeric answer are rejected
("no_answer"), and so are numerals in another base.
"""

from __future__ import annotations

import fnmatch
import os
import re

from data_prep.answers import parse_answer

from .base import Example, Source, get_field, iter_question_answer_lines, resolve_files

# "In base 16, what is -1a + 2b?", "What is 101 (base 2) in base 16?": the answer is in that base.
_BASE_RE = re.compile(r"\bbase (\d+)\b")


class DeepMindMath(Source):
    kind = "deepmind_math"
    defaults = {"modules": "arithmetic__*", "require_answer": False}

    def _iter_raw(self):
        if not self.cfg.path:
            raise ValueError("deepmind_math reads local .txt files: give a path")
        root, files = resolve_files(self.cfg.path, exts=(".txt",))
        for f in files:
            name = os.path.splitext(os.path.basename(f))[0]
            if fnmatch.fnmatch(name, self.opts["modules"]):
                yield from iter_question_answer_lines(f, os.path.relpath(f, root))

    def fingerprint(self):
        fp = super().fingerprint()
        fp["files"] = {k: v for k, v in fp["files"].items() if k.endswith(".txt")}
        return fp

    def row_to_example(self, row, base_dir):
        question = get_field(row, "question").strip()
        answer = get_field(row, "answer").strip()
        bases = {int(b) for b in _BASE_RE.findall(question)}
        decimal = not bases or bases == {10}
        return Example(prompt=question, target=answer, answer=parse_answer(answer) if decimal else None,
                       answer_text=answer, number_spans=decimal)
