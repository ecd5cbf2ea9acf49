"""recipes.evaluation.evaluate on a vision-language model: a tiny random LLaVA (CLIP tower + Llama) built offline."""

from types import SimpleNamespace

from recipes.evaluation import evaluate as E
from recipes.inputs.vision import vision_prompt


def test_vision_shards_load_the_image_text_model_and_score_times(tiny_vl, tmp_path):
    res = E.evaluate(tiny_vl["model"], tiny_vl["test"], out=str(tmp_path / "r.json"), batch_size=4,
                     max_new_tokens=4, answer_format="time")
    assert res["settings"]["vision"] is True
    assert res["metrics"]["n"] == 6 and "time_gap" in res["metrics"]
    assert all(isinstance(e["prediction"], str) for e in res["examples"])


def test_vision_batches_generate_what_single_rows_do(tiny_vl):
    model, tok, processor = E.load_model(tiny_vl["model"], vision=True)
    rows = E.load_rows(tiny_vl["test"])
    assert all(r["image"] for r in rows)
    single = E.generate_texts(model, tok, rows, batch_size=1, max_new_tokens=4, processor=processor)
    batched = E.generate_texts(model, tok, rows, batch_size=4, max_new_tokens=4, processor=processor)
    assert single == batched


class _Vocab:
    def __init__(self, tokens, bos=None):
        self.tokens, self.bos_token = tokens, bos

    def get_vocab(self):
        return {t: i for i, t in enumerate(self.tokens)}


def test_vision_prompt_puts_the_placeholder_at_the_start_of_the_user_turn():
    llava = SimpleNamespace(image_token="<image>", tokenizer=_Vocab(["<s>"], bos="<s>"))
    chat = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat time?<|im_end|>\n"
    assert vision_prompt(chat, llava) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n<image>"
                                          "What time?<|im_end|>\n")
    assert vision_prompt("[INST]What time?[/INST]", llava) == "[INST]<image>What time?[/INST]"
    assert vision_prompt("<s>What time?", llava) == "<s><image>What time?"  # plain template: after BOS
    assert vision_prompt("What time?", llava) == "<image>What time?"
    qwen = SimpleNamespace(image_token="<|image_pad|>",
                           tokenizer=_Vocab(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]))
    assert vision_prompt("<|im_start|>user\nWhat time?", qwen) == \
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What time?"
