import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from helpers import train_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def tokenizers_dir(tmp_path_factory):
    """Four tokenizers trained once per session: {digits, llama3} x {plain, chat template}."""
    root = tmp_path_factory.mktemp("tokenizers")
    out = {}
    for style in ("digits", "llama3"):
        for chat in (False, True):
            name = f"{style}-{'chat' if chat else 'plain'}"
            out[name] = train_tokenizer(str(root / name), style, chat_template=chat)
    return out


@pytest.fixture(scope="session")
def digits_tok(tokenizers_dir):
    return tokenizers_dir["digits-plain"]


@pytest.fixture(scope="session")
def llama_chat_tok(tokenizers_dir):
    return tokenizers_dir["llama3-chat"]
