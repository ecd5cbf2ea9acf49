"""GSM8K: {"question", "answer"} where the answer is a rationale ending in "#### N".

Hub: `openai/gsm8k` (config "main"). The final number may carry thousands separators ("#### 1,200").
The target is the whole answer text (rationale included). `strip_calculator` removes the "<<48/2=24>>"
calculator annotations some pipelines drop; it is off by default to keep the papers' text.
"""

from __future__ import annotations

import re

from data_prep.answers import parse_answer

from .base import EMPTY_TARGET, NO_ANSWER, BadRecord, Example, Source, get_field

_CALC = re.compile(r"<<[^<>]*>>")


def final_answer(text: str) -> tuple[str | None, float | None]:
    """(answer text, value) after the last "####", or (None, None)."""
    if "####" not in text:
        return None, None
    answer = text.rsplit("####", 1)[1].strip()
    return answer, parse_answer(answer)


class GSM8K(Source):
    kind = "gsm8k"
    defaults = {"question_field": "question", "answer_field": "answer", "strip_calculator": False}

    def row_to_example(self, row, base_dir):
        question = get_field(row, self.opts["question_field"])
        answer = get_field(row, self.opts["answer_field"])
        if self.opts["strip_calculator"]:
            answer = _CALC.sub("", answer)
        if not answer.strip():
            raise BadRecord(EMPTY_TARGET, "the answer text is empty")
        text, value = final_answer(answer)
        if text is None:
            raise BadRecord(NO_ANSWER, "the answer has no '#### N' line")
        return Example(prompt=question.strip(), target=answer.strip(), answer=value, answer_text=text)
