"""Vision-language training: clock-time shards -> a tiny random LLaVA (CLIP tower + projector + Llama).

- `recipes.inputs.vision.training_inputs` keeps the shards' target tokens and labels exactly, expands each image
  to its patch tokens, keeps images in row order, and builds the same prompt evaluation generates from;
- the numeric objective on those inputs equals Hugging Face's own loss (CE only), and the chunked head
  equals the logits path with the image gradients included;
- a 2-rank DeepSpeed ZeRO-3 run trains the whole model (vision tower included), exports a model and
  processor that `recipes.evaluation.evaluate` loads and scores.
"""

from __future__ import annotations

import math

import pytest
import torch
import yaml
from safetensors.torch import load_file

pytest.importorskip("deepspeed")

from tests.recipes.torchrun_helpers import read_metrics, run_in_ranks  # noqa: E402

from data_prep.reader import ShardDataset  # noqa: E402
from recipes.reliability.export_writer import read_export  # noqa: E402
from recipes.inputs.vision import decode_image, load_processor, training_inputs, vision_inputs  # noqa: E402

IGNORE = -100
PATCHES = 4  # (28 / 14)^2 image tokens per image for the tiny processor


def _batch(tiny_vl, batch_size=4):
    ds = ShardDataset(tiny_vl["train"], batch_size=batch_size, shuffle=False)
    return next(iter(ds))


def test_training_inputs_keep_the_shard_targets_and_expand_each_image(tiny_vl):
    processor = load_processor(tiny_vl["model"])
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    batch = _batch(tiny_vl)
    inputs = training_inputs(processor, batch, pad_to_multiple_of=8)
    ids, labels, mask = inputs["input_ids"], inputs["labels"], inputs["attention_mask"]
    assert ids.shape[1] % 8 == 0 and labels.shape == ids.shape == mask.shape

    prompts = []
    for i in range(len(ids)):
        n = int(batch["attention_mask"][i].sum())
        shard_ids, shard_labels = batch["input_ids"][i, :n].tolist(), batch["labels"][i, :n].tolist()
        first = next(j for j, lab in enumerate(shard_labels) if lab != IGNORE)
        m = int(mask[i].sum())
        assert mask[i, :m].all() and not mask[i, m:].any()  # right padding
        assert (labels[i, m:] == IGNORE).all()
        # the target block is the shard's, token for token, and ends the row
        target = shard_ids[first:]
        assert ids[i, m - len(target):m].tolist() == target
        assert labels[i, m - len(target):m].tolist() == shard_labels[first:]
        assert (labels[i, :m - len(target)] == IGNORE).all()
        # the prompt gained exactly the image's patch tokens and otherwise kept the shard's ids
        prompt = ids[i, :m - len(target)].tolist()
        assert prompt.count(image_id) == PATCHES
        assert [t for t in prompt if t != image_id] == shard_ids[:first]
        prompts.append(prompt)

    # images stay in row order: the pixels are the image processor's output for each row's own image
    own = processor.image_processor(images=[decode_image(b) for b in batch["images"]], return_tensors="pt")
    assert torch.equal(inputs["pixel_values"], own["pixel_values"])

    # evaluation builds the same prompt (left-padded, no target)
    shard_prompts = []
    for i in range(len(ids)):
        n = int(batch["attention_mask"][i].sum())
        first = next(j for j, lab in enumerate(batch["labels"][i, :n].tolist()) if lab != IGNORE)
        shard_prompts.append(batch["input_ids"][i, :first].tolist())
    gen = vision_inputs(processor, shard_prompts, batch["images"])
    assert "labels" not in gen
    for i, prompt in enumerate(prompts):
        m = int(gen["attention_mask"][i].sum())
        assert not gen["attention_mask"][i, :-m].any()  # left padding
        assert gen["input_ids"][i, -m:].tolist() == prompt
    assert torch.equal(gen["pixel_values"], inputs["pixel_values"])


def test_a_row_without_image_or_too_long_is_an_error_naming_the_record(tiny_vl):
    processor = load_processor(tiny_vl["model"])
    batch = _batch(tiny_vl, batch_size=2)
    record = int(batch["record"][1])
    batch["images"] = [batch["images"][0], None]
    with pytest.raises(ValueError, match=rf"records \[{record}\].*no image"):
        training_inputs(processor, batch)
    batch = _batch(tiny_vl, batch_size=2)
    with pytest.raises(ValueError, match=rf"record {int(batch['record'][0])}: \d+ tokens .* data.seq_len=8"):
        training_inputs(processor, batch, max_length=8)
    batch["images"] = [b"not an image", batch["images"][1]]
    with pytest.raises(ValueError, match=rf"record {int(batch['record'][0])}: the image bytes do not decode"):
        training_inputs(processor, batch)


def _heads_agree(model, vocab, inputs, terms: dict, chunk_size: int, tower: str, rel: float):
    """CE alone through `NumericCausalLM` is Hugging Face's own loss; with `terms`, the chunked head gives
    the logits path's loss, terms and every gradient, and the images reach the loss (a gradient of the
    `tower` parameters is nonzero). Returns the logits path's output."""
    from numloss import Objective
    from numloss.adapters.hf import NumericCausalLM

    ce_only = NumericCausalLM(model, Objective(vocab, {}), chunked=False)
    assert ce_only(**inputs).loss.item() == pytest.approx(model(**inputs).loss.item(), rel=1e-6)
    results = []
    for chunked in (False, True):
        model.zero_grad()
        out = NumericCausalLM(model, Objective(vocab, {"terms": terms}), chunked=chunked, chunk_size=chunk_size)(**inputs)
        out.loss.backward()
        results.append((out, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}))
    (logits, grads_a), (chunked, grads_b) = results
    assert chunked.loss.item() == pytest.approx(logits.loss.item(), rel=rel)
    for name in terms:
        assert chunked.terms[name].item() == pytest.approx(logits.terms[name].item(), rel=rel), name
    assert set(grads_a) == set(grads_b)
    assert any(tower in k and grads_a[k].abs().max() > 0 for k in grads_a)
    for k in grads_a:
        torch.testing.assert_close(grads_b[k], grads_a[k], rtol=1e-4, atol=1e-6, msg=k)
    return logits


def test_the_numeric_objective_on_vision_inputs_matches_hf_and_the_chunked_head(tiny_vl):
    from numloss import NumericVocab
    from recipes.config import Recipe
    from recipes.engines.deepspeed.runtime.model import build_model

    processor = load_processor(tiny_vl["model"])
    recipe = Recipe()
    recipe.model.config, recipe.model.vision, recipe.model.dtype = dict(tiny_vl["config"]), True, "float32"
    torch.manual_seed(0)
    model, _ = build_model(recipe, {"zero_optimization": {"stage": 0}}, torch.device("cpu"))  # the config path
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    width = model.get_output_embeddings().weight.shape[0]
    vocab = NumericVocab.from_tokenizer(processor.tokenizer, policy="digits", vocab_size=width)
    assert vocab.size == 10
    inputs = training_inputs(processor, _batch(tiny_vl))
    out = _heads_agree(model, vocab, inputs, {"smmd": {}, "ntl_was": {}}, chunk_size=16, tower="vision_tower",
                       rel=1e-5)
    assert out.terms["smmd"] > 0


def test_two_rank_zero3_trains_a_tiny_vision_language_model_and_evaluates_it(tiny_vl, tmp_path):
    from transformers import AutoModelForImageTextToText

    from recipes.evaluation.evaluate import evaluate

    recipe = {
        "name": "tiny-vl",
        "model": {"name_or_path": tiny_vl["model"], "vision": True, "dtype": "float32"},
        "data": {"train": tiny_vl["train"], "eval": tiny_vl["test"]},
        "loss": {"objective": {"terms": {"smmd": {}}}, "head": "chunked", "chunk_size": 32},
        "optim": {"lr": 1e-3},
        "train": {"steps": 3, "micro_batch_size": 2, "progress": False},
        "eval": {"answer_format": "time"},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = tmp_path / "run"
    run_in_ranks(path, out)  # numbers and files: the loop in pre-started ranks

    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and r["term/smmd"] > 0 and r["numeric_positions"] > 0 for r in rows)

    final = out / "final"
    load_processor(str(final))  # the processor travels with the model (tokenizer + image processor)
    # the exported model holds the trained weights: DeepSpeed's own fp32 consolidation of the last
    # checkpoint, read independently, equals what loads from final/
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    checkpoint = {k.removeprefix("model."): v for k, v in
                  get_fp32_state_dict_from_zero_checkpoint(str(out / "checkpoints")).items()}
    # in the checkpoint format transformers itself writes (the tiny model was saved by save_pretrained)
    assert set(read_export(final)) == \
        set(load_file(str(tiny_vl["root"] / "model" / "model.safetensors")))
    trained = AutoModelForImageTextToText.from_pretrained(str(final)).state_dict()
    initial = AutoModelForImageTextToText.from_pretrained(tiny_vl["model"]).state_dict()
    assert set(trained) == set(checkpoint) == set(initial)
    for name, value in checkpoint.items():
        assert torch.equal(trained[name], value), name
    changed = {k for k in initial if not torch.equal(trained[k], initial[k])}
    for part in ("vision_tower", "multi_modal_projector", "language_model", "lm_head"):
        assert any(part in k for k in changed), part  # the whole model trains, the tower included

    res = evaluate(str(final), tiny_vl["test"], batch_size=3, max_new_tokens=4, answer_format="time")
    assert res["settings"]["vision"] and res["metrics"]["n"] == 6


def test_qwen2_5_vl_through_the_wrapper_matches_hf_and_the_chunked_head():
    """The shipped VL recipes' backbone: mrope positions and `image_grid_thw` reach the model from
    both heads. Inputs are built by hand (image placeholder tokens + patch vectors) because the Qwen
    processor needs torchvision for its video half, which has no CPU wheel for this torch here."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from numloss import NumericVocab

    vocab_size, image, start, end, video = 64, 60, 61, 62, 63
    config = AutoConfig.for_model(
        "qwen2_5_vl", vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, bos_token_id=1, eos_token_id=2,
        vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
                       "fullatt_block_indexes": [0]},
        image_token_id=image, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config)
    # two rows, each a 56x56 image: a 4x4 patch grid merged 2x2 into 4 image tokens
    rows = [([1, start] + [image] * 4 + [end, 5, 6, 7], [10, 11, 12, 2]),
            ([1, start] + [image] * 4 + [end, 5], [13, 14, 2])]
    width = max(len(p) + len(t) for p, t in rows)
    ids = torch.zeros(2, width, dtype=torch.long)
    labels = torch.full((2, width), IGNORE)
    mask = torch.zeros(2, width, dtype=torch.long)
    for b, (prompt, target) in enumerate(rows):
        n = len(prompt) + len(target)
        ids[b, :n] = torch.tensor(prompt + target)
        labels[b, len(prompt):n] = torch.tensor(target)
        mask[b, :n] = 1
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels,
              "pixel_values": torch.randn(2 * 16, 3 * 2 * 14 * 14), "image_grid_thw": torch.tensor([[1, 4, 4]] * 2)}
    digits = NumericVocab(list(range(10, 20)), list(range(10)), vocab_size=vocab_size)

    _heads_agree(model, digits, inputs, {"smmd": {}}, chunk_size=4, tower="visual", rel=1e-6)


class _Tok:
    padding_side, pad_token_id, eos_token_id, bos_token = "left", 0, 2, None

    def decode(self, ids, skip_special_tokens=False):
        return " " + " ".join(map(str, ids))


class _Processor:
    """Expands "<image>" to two image tokens (id 99, token type 1) and gives each image a pixel tensor."""

    image_token = "<image>"

    def __init__(self):
        self.tokenizer = _Tok()

    def __call__(self, text, images, return_tensors, padding, add_special_tokens):
        assert self.tokenizer.padding_side == "right" and not add_special_tokens
        rows = [[t for w in s.split() for t in ([99, 99] if w == "<image>" else [int(w)])] for s in text]
        width = max(map(len, rows))
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": (ids == 99).long(),
                "pixel_values": torch.ones(len(images or []), 3, 2, 2)}


def test_vision_inputs_reassemble_rows_by_hand(monkeypatch):
    processor = _Processor()
    images = [b"png-0", b"png-1"]
    prompts, targets = [[5, 6], [7]], [([10, 11], [10, 11]), ([12], [12])]
    decoded = []
    monkeypatch.setattr("recipes.inputs.vision.decode_image", lambda data, where: decoded.append((data, where)) or data)
    train = vision_inputs(processor, prompts, images, targets, pad_to_multiple_of=4, where=["r0", "r1"])
    gen = vision_inputs(processor, prompts, images)
    assert decoded[:2] == [(b"png-0", "r0"), (b"png-1", "r1")]
    assert train["input_ids"].tolist() == [[99, 99, 5, 6, 10, 11, 0, 0], [99, 99, 7, 12, 0, 0, 0, 0]]
    assert train["labels"].tolist() == [[IGNORE] * 4 + [10, 11, IGNORE, IGNORE], [IGNORE] * 3 + [12] + [IGNORE] * 4]
    assert train["attention_mask"].tolist() == [[1] * 6 + [0] * 2, [1] * 4 + [0] * 4]
    assert train["token_type_ids"].tolist() == [[1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0]]
    assert train["pixel_values"].shape == (2, 3, 2, 2)
    assert gen["input_ids"].tolist() == [[99, 99, 5, 6], [0, 99, 99, 7]] and "labels" not in gen
    assert gen["attention_mask"].tolist() == [[1, 1, 1, 1], [0, 1, 1, 1]]
    assert gen["token_type_ids"].tolist() == [[1, 1, 0, 0], [0, 1, 1, 0]]
    assert processor.tokenizer.padding_side == "left"  # restored
