"""Any JSONL / JSON / Parquet / CSV (or hub dataset) with configurable field names.

Options: `prompt_field`, `target_field`, `answer_field` (optional; without it the answer is read from
the target: the text after the last "####" if there is one, else `data_prep.answers.read_answer`'s answer),
`image_field` (optional). An empty prompt is allowed (plain language-model text).
"""

from __future__ import annotations

from data_prep.answers import parse_answer, read_answer

from .base import Example, Source, get_field, load_image
from .gsm8k import final_answer


def answer_from_target(target: str) -> tuple[str | None, float | None]:
    text, value = final_answer(target)
    if text is not None:
        return text, value
    reading = read_answer(target)
    if reading is None:
        return None, None
    return reading.numeral, reading.value


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
            answer_text, answer = (None if raw is None else str(raw)), parse_answer(raw)
        else:
            answer_text, answer = answer_from_target(target)
        image = None
        if self.opts["image_field"]:
            image = load_image(get_field(row, self.opts["image_field"], kind="any"), base_dir)
        return Example(prompt=str(prompt).strip(), target=target.strip(), answer=answer,
                       answer_text=answer_text, image=image)
