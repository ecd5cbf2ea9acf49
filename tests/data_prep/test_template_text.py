"""data_prep refuses a template whose own text the tokenizer turns into its unknown token (the plain
template's "\\n" with a tokenizer that has no "\\n"), before any record is read, unless `--allow-unk`;
and warns about characters a tokenizer without an unknown token drops."""

import json
import os

import pytest

from data_prep.build import BuildConfig
from data_prep.sources import SourceConfig
from data_prep.tokenize import Encoder, Item, TokenizeConfig
from data_prep.sources import make_source

ARITHMETIC = SourceConfig("arithmetic", options={"n": 6, "max_digits": 2})


def _tokenizer(out_dir, unk: bool) -> str:
    """A BPE over the arithmetic prompts' characters, without "\\n"; with or without an unknown token."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>" if unk else None))
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="isolated")
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    text = "Evaluate Multiply Calculate and What is 0123456789 + - * / = . ( ) ? §"
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>" if unk else None, bos_token="<s>",
                            eos_token="</s>", pad_token="<pad>").save_pretrained(str(out_dir))
    return str(out_dir)


def _first_row(encoder):
    src = make_source(ARITHMETIC)
    ref, raw = next(iter(src.iter_raw()))
    return encoder.encode([Item(0, f"arithmetic/{ref}", src.to_example(raw, ref))])[0].to_pylist()[0]


def test_the_unknown_token_in_the_template_is_refused_unless_allowed(tmp_path):
    path = _tokenizer(tmp_path / "tok", unk=True)
    with pytest.raises(ValueError, match=r"plain template's own text into its unknown token '<unk>' \(separator: '\\n'\)"
                                         r".*--plain-separator.*--allow-unk"):
        Encoder(TokenizeConfig(path, template="plain"))
    from transformers import AutoTokenizer

    unk = AutoTokenizer.from_pretrained(path).unk_token_id
    allowed = _first_row(Encoder(TokenizeConfig(path, template="plain", allow_unk=True)))
    assert allowed["input_ids"].count(unk) == 1  # what was refused: the separator, as <unk>, in the row
    spaced = _first_row(Encoder(TokenizeConfig(path, template="plain", plain_separator=" ")))
    assert unk not in spaced["input_ids"]
    # a chat template's own text is checked the same way ("§" is known: not named)
    chat = AutoTokenizer.from_pretrained(path)
    chat.chat_template = "{% for m in messages %}§{{ m['content'] }}\n{% endfor %}"
    chat.save_pretrained(str(tmp_path / "chat"))
    with pytest.raises(ValueError, match=r"chat template's own text .*\(after the prompt: '\\n'; after the answer:"
                                         r" '\\n'\)"):
        Encoder(TokenizeConfig(str(tmp_path / "chat")))
    # allowing it does not change the build's identity (BuildConfig: what decides the output's bytes)
    assert BuildConfig([ARITHMETIC], TokenizeConfig(path, allow_unk=True)).to_dict() == \
        BuildConfig([ARITHMETIC], TokenizeConfig(path)).to_dict()


def test_the_cli_refuses_before_writing_and_builds_with_allow_unk(tmp_path, capsys):
    from data_prep.__main__ import main

    path = _tokenizer(tmp_path / "tok", unk=True)
    args = ["build", "--source", "arithmetic", "--opt", "n=6", "--tokenizer", path, "--template", "plain",
            "--workers", "1", "--no-progress"]
    assert main([*args, "--out", str(tmp_path / "refused")]) != 0
    assert "--allow-unk" in capsys.readouterr().err
    assert not any(name.startswith("shard-") for name in os.listdir(tmp_path / "refused"))
    assert main([*args, "--out", str(tmp_path / "allowed"), "--allow-unk"]) == 0
    assert json.load(open(tmp_path / "allowed" / "manifest.json"))["totals"]["examples_kept"] == 6


def test_characters_dropped_by_a_tokenizer_without_an_unknown_token_are_warned_about(tmp_path):
    path = _tokenizer(tmp_path / "tok", unk=False)
    with pytest.warns(UserWarning, match=r"drops characters of the plain template's own text .*separator: '\\n'"):
        Encoder(TokenizeConfig(path, template="plain"))
