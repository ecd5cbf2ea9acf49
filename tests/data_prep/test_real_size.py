"""Builds with tokenizers of real size (128k-151k tokens, assembled offline), in worker processes.

A numeric vocabulary of a real tokenizer is big enough that torch builds its tables with its OpenMP
thread pool, in each worker (and in the main process with workers=0, or wherever a caller built one).
Workers forked from a main process that had done so inherited the pool without its threads and waited
forever; these tests run the command line in a subprocess with a deadline, so a hang fails the test
instead of hanging the suite.
"""

import os
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
from tests.data_prep.helpers import GSM8K_ROWS, hanging_encode_chunk, write_jsonl
from tests.data_prep.test_build import ROOT, _finish, files_of

from data_prep import BuildConfig, ShardConfig, SourceConfig, TokenizeConfig, build
from data_prep import workers as workers_module


def _arith_rows(n):
    return [{"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
            for a, b in ((i * 7919 % 100_000, i * 104_729 % 10_000) for i in range(n))]


@pytest.mark.parametrize("style", ["llama3", "qwen"])
def test_parallel_cli_build_with_real_size_tokenizer(tmp_path, real_size_toks, style):
    tok = real_size_toks[style]
    data = write_jsonl(str(tmp_path / "train.jsonl"), GSM8K_ROWS * 10 + _arith_rows(600))
    out = str(tmp_path / "par")
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("OMP_NUM_THREADS", None)  # the hang needs torch's default thread count (> 1 on 2+ cores)
    args = ["build", "--source", "gsm8k", "--path", data, "--tokenizer", tok, "--out", out,
            "--workers", "2", "--chunk-size", "64", "--shard-mb", "0.05", "--no-progress"]
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "data_prep", *args], cwd=ROOT, env=env,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = _finish(proc, timeout=300)  # 10-80 s measured on a loaded 2-core machine
    assert proc.returncode == 0, output
    seconds = time.monotonic() - t0
    # The same build in this process, encoded here: the workers' shards are byte for byte these.
    cfg = BuildConfig(sources=[SourceConfig("gsm8k", path=data)], tokenize=TokenizeConfig(tok),
                      shards=ShardConfig(shard_bytes=int(0.05 * (1 << 20))))
    m = build(cfg, str(tmp_path / "seq"), workers=0, progress=False)
    assert files_of(out) == files_of(tmp_path / "seq")
    assert len(m["shards"]) > 1 and m["totals"]["examples_kept"] == 640
    assert m["tokenizer"]["length"] == {"llama3": 128_256, "qwen": 151_665}[style]
    # The numeric positions are the digits of the answers (the vocabulary is the real-size one).
    row = pq.read_table(os.path.join(out, m["shards"][0]["file"])).slice(0, 1).to_pylist()[0]
    assert any(row["numeric_mask"]) and m["numeric_vocab"]["size"] == 10
    print(f"{style}: parallel CLI build {seconds:.1f} s")


def test_watchdog_fails_a_stalled_build_naming_the_part(tmp_path, digits_tok, monkeypatch):
    """A worker that never returns (here: one that sleeps on records 40-59) stops the build with an
    error naming the part and the records, within the stall timeout, and a rerun resumes."""
    data = write_jsonl(str(tmp_path / "train.jsonl"), _arith_rows(120))
    cfg = BuildConfig(sources=[SourceConfig("gsm8k", path=data)], tokenize=TokenizeConfig(digits_tok),
                      shards=ShardConfig(shard_bytes=2000))
    out = str(tmp_path / "out")
    ref = build(cfg, str(tmp_path / "ref"), workers=0, chunk_size=20, progress=False)
    # A first parallel build starts this process's forkserver: the stall below then is the only wait
    # longer than a worker's start-up, however loaded the machine.
    build(cfg, str(tmp_path / "warm"), workers=2, chunk_size=20, progress=False)
    assert files_of(tmp_path / "warm") == files_of(tmp_path / "ref")
    # The workers run hanging_encode_chunk (pickled by reference: they import helpers by name).
    monkeypatch.setenv("DATA_PREP_TEST_HANG_AT", "40")
    monkeypatch.setattr(workers_module, "_encode_chunk", hanging_encode_chunk)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as err:
        build(cfg, out, workers=2, chunk_size=20, progress=False, stall_timeout=10)
    waited = time.monotonic() - t0
    monkeypatch.undo()
    msg = str(err.value)
    assert "stalled in part" in msg and "records 40-59" in msg and "train.jsonl:41" in msg, msg
    assert "for 10 s" in msg and 10 <= waited < 90
    assert os.path.exists(os.path.join(out, "_progress.json"))
    assert not os.path.exists(os.path.join(out, "manifest.json"))
    m = build(cfg, out, workers=2, chunk_size=20, progress=False, stall_timeout=60)
    assert files_of(out) == files_of(tmp_path / "ref") and m["totals"] == ref["totals"]


def test_deepmind_surds_and_base_numerals_are_kept_with_their_numbers(tmp_path, real_size_toks):
    from tests.data_prep.test_sources import _write_deepmind
    from transformers import AutoTokenizer

    tok_dir = real_size_toks["llama3"]
    cfg = BuildConfig(sources=[SourceConfig("deepmind_math", path=_write_deepmind(tmp_path))],
                      tokenize=TokenizeConfig(tok_dir, template="plain"))
    m = build(cfg, str(tmp_path / "out"), workers=0, progress=False)
    assert m["totals"]["rejected"] == 0 and m["totals"]["examples_kept"] == 6
    rows = {r["example_id"].split("/")[-1]: r for r in
            pq.read_table(tmp_path / "out" / m["shards"][0]["file"]).to_pylist()}
    tok = AutoTokenizer.from_pretrained(tok_dir)

    def spans(r):
        return [(tok.decode(r["input_ids"][a:b]).strip(), v)
                for a, b, v in zip(r["span_start"], r["span_end"], r["span_value"])]

    surd = rows["arithmetic__simplify_surd.txt:1"]
    assert surd["answer"] is None and surd["answer_text"] == "-28 + 8*sqrt(7)"
    assert spans(surd) == [("-28", -28.0), ("8", 8.0), ("7", 7.0)]
    assert spans(rows["arithmetic__simplify_surd.txt:3"]) == [("7", 7.0), ("17", 17.0), ("6", 6.0)]
    hexa = rows["arithmetic__add_or_sub_in_base.txt:1"]
    assert hexa["answer"] is None and hexa["answer_text"] == "-191b" and spans(hexa) == []
    # The digits of a surd are still labelled numeric positions: the losses score them.
    assert sum(surd["numeric_mask"]) > 0
    assert rows["arithmetic__add_or_sub_in_base.txt:5"]["answer"] == -8.0
    assert spans(rows["arithmetic__add_or_sub_in_base.txt:5"]) == [("-8", -8.0)]
