import pytest

from tests.data_prep.helpers import assemble_tokenizer, train_tokenizer


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


@pytest.fixture(scope="session")
def real_size_toks(tmp_path_factory):
    """Tokenizers of real size, assembled once per session (about a second each):
    {"llama3": 128,256 tokens, digit groups; "qwen": 151,665 tokens, single digits, chat template}."""
    root = tmp_path_factory.mktemp("real_size_tokenizers")
    return {style: assemble_tokenizer(str(root / style), style) for style in ("llama3", "qwen")}


@pytest.fixture(scope="session", params=["digits", "qwen-151k"])
def build_tok(request, digits_tok, real_size_toks):
    """The tests that must hold at any tokenizer size run with a small one and with one of 151,665
    tokens: past about 32k entries torch builds the numeric vocabulary's tables with its thread pool."""
    return digits_tok if request.param == "digits" else real_size_toks["qwen"]
