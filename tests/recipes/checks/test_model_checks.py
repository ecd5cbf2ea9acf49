"""recipes.checks.model_checks: what the model's config (never the weights) says a recipe cannot do, before
any model is built: the most positions a row may use under both RoPE conventions (`context_limit`); a
vocabulary smaller than the tokenizer (and the labels the data holds past it); Megatron layouts the model
or the world cannot take (a TP that does not divide the KV heads or the intermediate size, a PP x VPP
that does not divide the layers), also through `recipes.validate` on a CPU recipe; AutoTP with fewer KV
heads than ranks under ZeRO-3. A tiny Llama config with a Llama-3-sized vocabulary (128,256 tokens), on
data built with that tokenizer.
"""

from __future__ import annotations

import pytest

from recipes.checks import preflight as checks
from recipes.checks.model_checks import context_limit
from recipes.validation.validate import validate_recipe
from tests.recipes.checks.helpers import REPO, VOCAB, llama3_recipe, refused


def test_context_limit_reads_both_rope_conventions():
    from transformers import AutoConfig

    llama31 = AutoConfig.for_model("llama", max_position_embeddings=131072, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    qwen_yarn = AutoConfig.for_model("qwen2", max_position_embeddings=32768, rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    assert context_limit(llama31)[0] == 131072  # written extended: 16 x 8192, not 8 x 8192
    assert context_limit(qwen_yarn)[0] == 131072  # written original: 4 x 32768
    assert context_limit(AutoConfig.for_model("gpt2", n_positions=1024))[0] == 1024


def test_a_vocabulary_smaller_than_the_tokenizer_and_its_labels_is_refused(llama3_data):
    message = refused(llama3_data, llama3_recipe(llama3_data, "model.config.vocab_size=128000"))
    assert f"model.tokenizer: {VOCAB} tokens, but the model's embedding and logits have vocab_size 128000" in message
    eos = llama3_data["tokenizer"].convert_tokens_to_ids("<|end_of_text|>")  # 128,001: the rows' last label
    assert f"data.train: label {eos} at {llama3_data['data']}/shard-" in message
    assert "is outside the model's vocabulary [0, 128000)" in message


@pytest.mark.parametrize("overrides, world, expected", [
    (["megatron.tp_size=4"], 8, "megatron.tp_size: 4 does not divide the model's 2 KV heads (query groups)"),
    (["megatron.pp_size=3"], 6, "megatron.pp_size x megatron.virtual_pp_size: 3 x 1 does not divide the model's 4 layers"),
    (["megatron.pp_size=2", "megatron.virtual_pp_size=4", "train.grad_accum=2"], 2,
     "megatron.pp_size x megatron.virtual_pp_size: 2 x 4 does not divide the model's 4 layers"),
    (["megatron.tp_size=2"], 3, "megatron.tp_size x megatron.pp_size: 2 x 1 does not divide the world of 3 ranks"),
    (["megatron.tp_size=3", "model.config.num_attention_heads=6", "model.config.num_key_value_heads=6",
      "model.config.hidden_size=18", "model.config.intermediate_size=32"], 3,
     "megatron.tp_size: 3 does not divide the model's 32 intermediate size"),
])
def test_megatron_layouts_the_model_cannot_take_are_refused(llama3_data, overrides, world, expected):
    recipe = llama3_recipe(llama3_data, "train.engine=megatron", *overrides)
    assert expected in refused(llama3_data, recipe, world)
    cpu = [f"cluster.cpu_ranks_per_node={world}", "cluster.gpus_per_node=0"]  # recipes.validate, a CPU recipe
    rep = validate_recipe(REPO / "recipes/configs/demo.yaml", [
        f"model.tokenizer={llama3_data['tok']}", f"data.train={llama3_data['data']}", "train.engine=megatron",
        "train.micro_batch_size=4", "train.global_batch_size=null", "data.eval=null", "model.config.vocab_size=128256",
        "model.config.num_hidden_layers=4", "model.config.num_key_value_heads=2", "model.config.intermediate_size=32",
        *overrides, *cpu], offline=True, size=False)
    key = expected.split(":")[0]  # validate words the world's error after the recipe's cluster section
    assert any(e.startswith(key) for e in rep.errors), rep.render()


def test_autotp_with_fewer_kv_heads_than_ranks_under_zero3_is_refused(llama3_data):
    message = refused(llama3_data, llama3_recipe(llama3_data, "deepspeed.tp_size=4", "train.micro_batch_size=2"), 4)
    assert "deepspeed.tp_size: the model has 2 KV heads, fewer than tp_size 4" in message
    checks.preflight(llama3_recipe(llama3_data, "deepspeed.tp_size=4", "train.micro_batch_size=2",
                                   "deepspeed.zero_stage=2"), 4,
                     tokenizer=llama3_data["tokenizer"])  # AutoTP splits unevenly at ZeRO 0-2
    assert "deepspeed.tp_size: 2 does not divide the world of 3 ranks" in refused(
        llama3_data, llama3_recipe(llama3_data, "deepspeed.tp_size=2"), 3)
