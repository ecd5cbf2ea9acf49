"""recipes.evaluate on a vision-language model: a tiny random LLaVA (CLIP tower + Llama) built offline."""

import pytest

from recipes import evaluate as E


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    import torch
    from helpers import CHATML, train_tokenizer
    from transformers import (AutoTokenizer, CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration,
                              LlavaProcessor)

    from data_prep import BuildConfig, SourceConfig, TokenizeConfig, build

    root = tmp_path_factory.mktemp("vl")
    train_tokenizer(str(root / "tok"), "digits", chat_template=True)
    tok = AutoTokenizer.from_pretrained(str(root / "tok"))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<image>"]})
    tok.save_pretrained(str(root / "tok"))
    processor = LlavaProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 28},
                                                                  crop_size={"height": 28, "width": 28}),
                               tokenizer=tok, chat_template=CHATML, patch_size=14,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1)
    cfg = LlavaConfig(
        text_config=dict(model_type="llama", vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=256),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14),
        image_token_index=tok.get_vocab()["<image>"], vision_feature_select_strategy="default",
        vision_feature_layer=-1, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(cfg)
    model.save_pretrained(str(root / "model"))
    processor.save_pretrained(str(root / "model"))
    build(BuildConfig(sources=[SourceConfig("clock", options={"n": 6, "min_size": 56, "max_size": 64})],
                      tokenize=TokenizeConfig(str(root / "tok"), max_length=128)),
          str(root / "data"), workers=0, progress=False)
    return str(root / "model"), str(root / "data")


def test_vision_shards_load_the_image_text_model_and_score_times(tiny_vl, tmp_path):
    model_dir, data_dir = tiny_vl
    res = E.evaluate(model_dir, data_dir, out=str(tmp_path / "r.json"), batch_size=4, max_new_tokens=4,
                     answer_format="time")
    assert res["settings"]["vision"] is True
    assert res["metrics"]["n"] == 6 and "time_gap" in res["metrics"]
    assert all(isinstance(e["prediction"], str) for e in res["examples"])


def test_vision_batches_generate_what_single_rows_do_and_place_the_image_in_the_user_turn(tiny_vl):
    model_dir, data_dir = tiny_vl
    model, tok, processor = E.load_model(model_dir, vision=True)
    rows = E.load_rows(data_dir)
    assert all(r["image"] for r in rows)
    text = E.vision_prompt(tok.decode(rows[0]["prompt_ids"], skip_special_tokens=False), processor)
    assert text.count("<image>") == 1 and "<|im_start|>user\n<image>" in text
    single = E.generate_texts(model, tok, rows, batch_size=1, max_new_tokens=4, processor=processor)
    batched = E.generate_texts(model, tok, rows, batch_size=4, max_new_tokens=4, processor=processor)
    assert single == batched
