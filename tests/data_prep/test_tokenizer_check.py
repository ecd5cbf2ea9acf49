"""data_prep.tokenizer_check: what a build can tell about its tokenizer before any worker loads it (the
build's refusal through the CLI: tests/data_prep/test_cli.py)."""

from data_prep.tokenizer_check import tokenizer_problem


def test_a_local_directory_passes_and_paths_and_uncached_names_are_named_offline(tmp_path, digits_tok, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    assert tokenizer_problem(digits_tok) is None
    for path in (str(tmp_path / "missing"), "./tok", "runs/x/tok"):  # paths, never taken for hub names
        assert tokenizer_problem(path).startswith(f"--tokenizer {path}: no such directory ("), path
    said = tokenizer_problem("org/name")
    assert said.startswith("--tokenizer org/name: not in the Hugging Face cache and HF_HUB_OFFLINE is set")
    assert "a local directory that holds the tokenizer" in said and "\n" not in said
