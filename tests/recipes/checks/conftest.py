"""Fixtures of the recipes.checks tests: data built with a Llama-3-sized tokenizer (128,256 tokens,
assembled offline), against which a tiny model config's vocabulary, positions and heads are checked
(tests/recipes/checks/helpers.py builds its recipe). Built once per session: the tests only read it (a
test that changes the data changes a copy)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from data_prep import BuildConfig, ShardConfig, SourceConfig, TokenizeConfig, build
from recipes.experiments.real_tokenizers import assemble_tokenizer


@pytest.fixture(scope="session")
def llama3_data(tmp_path_factory):
    """A 128,256-token Llama-3-like tokenizer, 24 arithmetic rows built with it, and that tokenizer loaded."""
    root = tmp_path_factory.mktemp("llama3_data")
    tok = assemble_tokenizer(str(root / "tok"), "llama3")
    build(BuildConfig(sources=[SourceConfig("arithmetic", options={"n": 24, "max_digits": 3})],
                      tokenize=TokenizeConfig(tok, max_length=64),
                      shards=ShardConfig(shard_bytes=3000, row_group_rows=8)),
          str(root / "data"), workers=0, progress=False)
    return {"root": root, "tok": tok, "data": root / "data", "tokenizer": AutoTokenizer.from_pretrained(tok)}
