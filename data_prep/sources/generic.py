"""Any JSONL / JSON / Parquet / CSV (or hub dataset) with configurable field names.

Options: `prompt_field`, `target_field`, `answer_field` (optional; without it the answer is parsed from
the target: the text after the last "####" if there is one, else the last number in the target),
`image_field` (optional). An empty prompt is allowed (plain language-model text).
"""

from __future__ import annotations

import re

from .base import Example, Source, get_field, load_image, parse_number
from .gsm8k import final_answer

_LAST_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")


def answer_from_target(target: str) -> tuple[str | None, float | None]:
    text, value = final_answer(target)
    if text is not None:
        return text, value
    found = _LAST_NUMBER.findall(target)
    if not found:
        return None, None
    return found[-1], parse_number(found[-1])


class Generic(Source):
    kind = "generic"
    defaults = {"prompt_field": "prompt", "target_field": "target", "answer_field": None,
                "image_field": None}

    @property
    def has_images(self):  # type: ignore[override]
        return self.opts["image_field"] is not None

    def row_to_example(self, row, base_dir):
        prompt = row.get(self.opts["prompt_field"]) if self.opts["prompt_field"] else ""
        if self.opts["prompt_field"] and prompt is None:
            get_field(row, self.opts["prompt_field"])  # raises missing_field
        target = get_field(row, self.opts["target_field"])
        if self.opts["answer_field"]:
            raw = row.get(self.opts["answer_field"])
            answer_text, answer = (None if raw is None else str(raw)), parse_number(raw)
        else:
            answer_text, answer = answer_from_target(target)
        image = None
        if self.opts["image_field"]:
            image = load_image(get_field(row, self.opts["image_field"], kind="any"), base_dir)
        return Example(prompt=str(prompt).strip(), target=target.strip(), answer=answer,
                       answer_text=answer_text, image=image)
