"""DeepMind Mathematics, arithmetic modules: text files of alternating question / answer lines.

`path` is a .txt file, a directory of them (e.g. `train-easy/`) or a glob; `modules` filters the
file names (default: the arithmetic ones). Answers may be integers, decimals or fractions ("-2/3").
"""

from __future__ import annotations

import fnmatch
import os

from .base import Example, Source, get_field, iter_question_answer_lines, parse_number, resolve_files


class DeepMindMath(Source):
    kind = "deepmind_math"
    defaults = {"modules": "arithmetic__*"}

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
        return Example(prompt=question, target=answer, answer=parse_number(answer), answer_text=answer)
