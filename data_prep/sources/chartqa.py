"""ChartQA: {"image", "query", "label"} (`HuggingFaceM4/ChartQA` on the hub).

`label` is a list of strings on the hub and a string in the original JSON; the first one is the
target. The image may be bytes, an HF Image dict ({"bytes", "path"}) or a path relative to the data
file. Many ChartQA answers are not numbers ("Yes", a country): with the default `require_answer`
they are rejected as `no_answer`; pass require_answer=false to keep them (answer is then null).
The image bytes are carried as they are; the vision-language processor is applied at training time.
"""

from __future__ import annotations

from data_prep.answers import parse_answer

from .base import Example, Source, get_field, load_image


class ChartQA(Source):
    kind = "chartqa"
    has_images = True
    defaults = {"image_field": "image", "query_field": "query", "label_field": "label"}

    def row_to_example(self, row, base_dir):
        query = get_field(row, self.opts["query_field"], kind="any")
        label = get_field(row, self.opts["label_field"], kind="any")
        if isinstance(label, list):
            label = label[0] if label else ""
        label = str(label).strip()
        image = load_image(get_field(row, self.opts["image_field"], kind="any"), base_dir)
        return Example(prompt=str(query).strip(), target=label, answer=parse_answer(label),
                       answer_text=label, image=image)
