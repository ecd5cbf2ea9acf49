"""`python -m data_prep build` and `inspect` as a user runs them."""

import json
import os
import subprocess
import sys

from tests.data_prep.helpers import GSM8K_ROWS, write_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(*args):
    return subprocess.run([sys.executable, "-m", "data_prep", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)


def test_build_and_inspect(tmp_path, tokenizers_dir):
    tok = tokenizers_dir["digits-chat"]
    data = write_jsonl(str(tmp_path / "train.jsonl"), GSM8K_ROWS, raw_lines=["{oops"])
    out = str(tmp_path / "out")
    r = run("build", "--source", "gsm8k", "--path", data, "--tokenizer", tok, "--out", out,
            "--workers", "1", "--max-reject-fraction", "0.5")
    assert r.returncode == 0, r.stderr
    assert "read 5 = kept 4 + rejected 1" in r.stdout
    assert "rec/s" in r.stderr  # the progress bar reports records per second
    m = json.load(open(os.path.join(out, "manifest.json")))
    assert m["tokenizer"]["template"] == "chat" and m["totals"]["examples_kept"] == 4

    r = run("inspect", out, "--row", "1")
    assert r.returncode == 0, r.stderr
    text = r.stdout
    assert "records read 5 = kept 4 + rejected 1" in text and "invalid_json 1" in text
    assert "gsm8k: train.jsonl" in text and "shard-00000.parquet" in text
    # Row 1 is "1,250 + 350 = 1,600 / #### 1,600": masked prompt, numeric digits, spans with values.
    assert "[<|im_start|>]" in text and "«1»⟨,⟩«2»«5»«0»" in text and "⟨<|im_end|>⟩" in text
    assert "1600 @ " in text and "'1,600'" in text


def test_cli_errors_are_clear(tmp_path, digits_tok, capsys):
    from data_prep.__main__ import main

    assert main(["build", "--source", "gsm8k", "--path", str(tmp_path / "missing.jsonl"), "--tokenizer",
                 digits_tok, "--out", str(tmp_path / "o"), "--workers", "0"]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    assert main(["build", "--source", "arithmetic", "--opt", "nn=3", "--tokenizer", digits_tok, "--out",
                 str(tmp_path / "o")]) == 2
    assert "unknown option" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path)]) == 2
    assert "no manifest.json" in capsys.readouterr().err


def test_a_missing_input_and_an_unreachable_tokenizer_are_one_line_before_any_worker(tmp_path, digits_tok, capsys,
                                                                                        monkeypatch):
    """Both found before the worker pool starts: a missing input file first (it was reported only after the
    workers had fetched the tokenizer), then a tokenizer that cannot be loaded from here, in one line naming
    --tokenizer and that a local directory works (offline it was a minute of Hub retries, then a worker
    pool traceback). Workers are started by nobody: `start_encoding` is replaced by one that fails."""
    import importlib

    B = importlib.import_module("data_prep.build")  # the module: `data_prep.build` is also its function
    from data_prep.__main__ import main

    monkeypatch.setattr(B, "start_encoding", lambda *a, **k: (_ for _ in ()).throw(AssertionError("workers started")))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))  # nothing cached: the hub would be asked
    data = write_jsonl(str(tmp_path / "train.jsonl"), GSM8K_ROWS)
    cases = [
        (str(tmp_path / "missing.jsonl"), "nobody/never-cached", f"error: no such file or directory: {tmp_path / 'missing.jsonl'}"),
        (data, "nobody/never-cached", "error: --tokenizer nobody/never-cached: not in the Hugging Face cache and "
                                      "HF_HUB_OFFLINE is set (a local directory that holds the tokenizer (one saved "
                                      "with save_pretrained) works offline)"),
        (data, str(tmp_path / "no" / "tok"), f"error: --tokenizer {tmp_path / 'no' / 'tok'}: no such directory"),
    ]
    for path, tokenizer, said in cases:
        code = main(["build", "--source", "gsm8k", "--path", path, "--tokenizer", tokenizer,
                     "--out", str(tmp_path / "o"), "--workers", "2"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith(said), err
