"""SVAMP: {"Body", "Question", "Equation", "Answer"} (a JSON array upstream; `ChilleD/SVAMP` on the hub).

Used for cross-dataset evaluation of GSM8K-trained models, so the target mirrors GSM8K's format:
the equation, then "#### N" with the answer, and the prompt is Body + " " + Question.
"""

from __future__ import annotations

from data_prep.answers import parse_answer

from .base import Example, Source, format_number, get_field


class SVAMP(Source):
    kind = "svamp"
    defaults = {}

    def row_to_example(self, row, base_dir):
        body = get_field(row, "Body").strip()
        question = get_field(row, "Question").strip()
        equation = get_field(row, "Equation").strip()
        value = parse_answer(row.get("Answer"))
        answer_text = format_number(value) if value is not None else str(row.get("Answer"))
        prompt = f"{body} {question}" if body else question
        target = f"{equation} = {answer_text}\n#### {answer_text}"
        return Example(prompt=prompt, target=target, answer=value, answer_text=answer_text)
