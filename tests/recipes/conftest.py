"""Shared fixtures for the recipes tests: a tiny tokenizer, tiny data_prep shards, a tiny random model."""

import pytest

from tests.data_prep.helpers import train_tokenizer


@pytest.fixture(scope="session")
def rec_tokenizer_dir(tmp_path_factory):
    return train_tokenizer(str(tmp_path_factory.mktemp("rec_tok") / "digits"), "digits")


@pytest.fixture(scope="session")
def rec_data_dir(tmp_path_factory, rec_tokenizer_dir):
    from data_prep import BuildConfig, ShardConfig, SourceConfig, TokenizeConfig, build

    out = str(tmp_path_factory.mktemp("rec_data") / "arith")
    build(BuildConfig(sources=[SourceConfig("arithmetic", options={"n": 24, "max_digits": 2})],
                      tokenize=TokenizeConfig(rec_tokenizer_dir, max_length=64),
                      shards=ShardConfig(shard_bytes=2000, row_group_rows=8)),
          out, workers=0, progress=False)
    return out


@pytest.fixture(scope="module")
def demo_on_test_data(rec_data_dir, rec_tokenizer_dir):
    """The demo recipe's overrides onto the 24-row test data: 2 ranks x 4 rows = a global batch of 8, 3 steps an
    epoch; the model's vocabulary sized to the test tokenizer (388 tokens)."""
    return [f"data.train={rec_data_dir}", f"model.tokenizer={rec_tokenizer_dir}", "train.micro_batch_size=4",
            "train.global_batch_size=8", "train.steps=3", "data.eval=null", "model.config.vocab_size=512"]


@pytest.fixture(scope="session")
def rec_model_dir(tmp_path_factory, rec_tokenizer_dir):
    """A tiny random Llama saved with its tokenizer, as recipes/train.py exports `final/`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tok = AutoTokenizer.from_pretrained(rec_tokenizer_dir)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    out = tmp_path_factory.mktemp("rec_run") / "tiny" / "final"
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="session")
def tiny_vl(tmp_path_factory):
    """A tiny random LLaVA built offline: tokenizer, processor and saved model in `model/`, its
    `model.config` section, and clock-time shards (`train`: 16 clocks, `test`: 6, other seed)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from data_prep import BuildConfig, SourceConfig, TokenizeConfig, build
    from data_prep.sources.clock import QUESTION
    from recipes.experiments.tiny import tiny_llava_config, tiny_vision_processor, train_tokenizer

    root = tmp_path_factory.mktemp("vl")
    train_tokenizer([QUESTION, "0123456789 : H MM"], root / "tok")
    processor = tiny_vision_processor(root / "tok", root / "model")
    config = tiny_llava_config(processor)
    kwargs = dict(config)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(kwargs.pop("model_type"), **kwargs))
    model.save_pretrained(str(root / "model"))
    for split, n, seed in (("train", 16, 0), ("test", 6, 1)):
        build(BuildConfig(sources=[SourceConfig("clock", options={"n": n, "seed": seed, "min_size": 56,
                                                                  "max_size": 64})],
                          tokenize=TokenizeConfig(str(root / "model"), max_length=128)),
              str(root / split), workers=0, progress=False)
    return {"root": root, "model": str(root / "model"), "config": config,
            "train": str(root / "train"), "test": str(root / "test")}
