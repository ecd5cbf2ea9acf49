"""Worker set-up, which runs while the main process waits for the build's header: a tokenizer that
cannot be loaded, a set-up that hangs and one whose error cannot be sent back each fail the build
with their cause, promptly, before anything is written; and the main process loads no tokenizer."""

import os
import subprocess
import sys
import time

import pytest
from tests.data_prep.helpers import hanging_init_worker, unsendable_init_worker
from tests.data_prep.test_build import ROOT, files_of

from data_prep import BuildConfig, SourceConfig, TokenizeConfig, build
from data_prep import workers as workers_module


def _cfg(tok):
    return BuildConfig(sources=[SourceConfig("arithmetic", options={"n": 60})], tokenize=TokenizeConfig(tok))


def test_a_tokenizer_that_cannot_load_fails_with_its_own_error(tmp_path):
    bad = tmp_path / "not-a-tokenizer"  # a directory without tokenizer files
    bad.mkdir()
    with pytest.raises(Exception) as local:
        build(_cfg(str(bad)), str(tmp_path / "w0"), workers=0, progress=False)
    t0 = time.monotonic()
    with pytest.raises(Exception) as pooled:
        build(_cfg(str(bad)), str(tmp_path / "w2"), workers=2, progress=False, stall_timeout=300)
    # The worker's exception itself (not a wrapper, not the watchdog's TimeoutError), long before
    # the stall timeout, and nothing written.
    assert type(pooled.value) is type(local.value) and str(pooled.value) == str(local.value)
    assert time.monotonic() - t0 < 120
    assert os.listdir(tmp_path / "w2") == []


def test_a_worker_hung_in_its_set_up_fails_the_build_naming_it(tmp_path, digits_tok, monkeypatch):
    monkeypatch.setattr(workers_module, "_init_worker", hanging_init_worker)  # pickled by reference
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as err:
        build(_cfg(digits_tok), str(tmp_path / "out"), workers=2, progress=False, stall_timeout=5)
    waited = time.monotonic() - t0
    msg = str(err.value)
    assert "no worker finished its set-up" in msg and digits_tok in msg, msg
    assert "in 5 s (stall_timeout)" in msg and 5 <= waited < 90, (msg, waited)
    assert os.listdir(tmp_path / "out") == []


def test_a_set_up_error_that_cannot_be_unpickled_is_reported_not_hung(tmp_path, digits_tok, monkeypatch):
    # Sent back as it is, the exception would fail to unpickle in the pool's result thread, which then
    # stops: the build would only end by the watchdog, without the cause.
    monkeypatch.setattr(workers_module, "_init_worker", unsendable_init_worker)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="worker set-up failed: TwoArgError: tokenizer: exploded"):
        build(_cfg(digits_tok), str(tmp_path / "out"), workers=2, progress=False, stall_timeout=120)
    assert time.monotonic() - t0 < 60


def test_with_workers_the_main_process_loads_no_tokenizer(tmp_path, digits_tok):
    """The header comes from a worker: the main process imports neither transformers nor torch, and
    the output is byte for byte the one the main process writes encoding alone (workers=0)."""
    script = tmp_path / "run.py"
    script.write_text(
        "import sys\n"
        "from data_prep import BuildConfig, SourceConfig, TokenizeConfig, build\n"
        "if __name__ == '__main__':\n"
        "    cfg = BuildConfig(sources=[SourceConfig('arithmetic', options={'n': 60})],\n"
        "                      tokenize=TokenizeConfig(sys.argv[1]))\n"
        "    build(cfg, sys.argv[2], workers=2, progress=False, stall_timeout=120)\n"
        "    print('loaded:', sorted(m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules))\n")
    out = str(tmp_path / "w2")
    proc = subprocess.run([sys.executable, str(script), digits_tok, out], cwd=ROOT, timeout=240,
                          env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loaded: []" in proc.stdout, proc.stdout
    build(_cfg(digits_tok), str(tmp_path / "w0"), workers=0, progress=False)
    assert files_of(out) == files_of(tmp_path / "w0")
