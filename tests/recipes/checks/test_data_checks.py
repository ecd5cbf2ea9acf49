"""recipes.checks.data_checks: the training data's tokens against the recipe and the model, from the
manifest's per-shard statistics, before any model is built (`recipes.checks.preflight.preflight`, on every
rank of `recipes.train`, and `recipes.validate`).

Data built with a Llama-3-sized tokenizer (128,256 tokens) against a tiny model config: a data.seq_len
below the longest row; rows past the model's positions (RoPE scaling counts); a label outside the
vocabulary; a row whose labels are one short; data with no scored label; a manifest without statistics
(scanned at start-up, or refused above the scan limit naming the command that records them). Each would
otherwise surface after the model was built (exit 1, a traceback, some without a shard or row). The
expected places (shard, row, record) are read from the Parquet files here, not from the manifest's
statistics.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from data_prep.stats import write_stats
from recipes.checks import data_checks
from recipes.checks import preflight as checks
from tests.recipes.checks.helpers import VOCAB, llama3_recipe, refused


def _rows(path) -> list[dict]:
    return pq.read_table(path).to_pylist()


def _copy_with(llama3_data, tmp_path, change) -> Path:
    """The built data copied, every shard's rows passed through `change(shard_file, rows)`, its statistics
    recomputed (`python -m data_prep stats`' pass), as data another tool wrote would be."""
    data = tmp_path / "data"
    shutil.copytree(llama3_data["data"], data)
    manifest = json.loads((data / "manifest.json").read_text())
    for shard in manifest["shards"]:
        path = data / shard["file"]
        f = pq.ParquetFile(path)
        rows = change(shard["file"], f.read().to_pylist())
        pq.write_table(pa.Table.from_pylist(rows, schema=f.schema_arrow), path, row_group_size=8)
        shard["bytes"] = os.path.getsize(path)
        del shard["stats"]
    (data / "manifest.json").write_text(json.dumps(manifest))
    assert write_stats(str(data)) == len(manifest["shards"])
    return data


def test_seq_len_below_the_longest_row_names_its_shard_and_row(llama3_data):
    n = max(len(r["input_ids"]) for s in llama3_data["data"].glob("shard-*.parquet") for r in _rows(s))
    message = refused(llama3_data, llama3_recipe(llama3_data, f"data.seq_len={n - 1}"))
    where = re.escape(str(llama3_data['data']))
    m = re.search(rf"data.seq_len: {n - 1} is shorter than the longest row of {where}, {n} "
                  rf"tokens at {where}/(shard-\d+\.parquet) row (\d+) \(record (\d+)\)", message)
    assert m, message
    row = _rows(llama3_data["data"] / m[1])[int(m[2])]  # the row named is one of the longest
    assert len(row["input_ids"]) == n and row["record"] == int(m[3])
    checks.preflight(llama3_recipe(llama3_data, f"data.seq_len={n}"), 2, tokenizer=llama3_data["tokenizer"])


def test_rows_past_the_models_positions_are_refused_and_rope_scaling_counts(llama3_data):
    message = refused(llama3_data, llama3_recipe(llama3_data, "model.config.max_position_embeddings=16"))
    assert "has rows that use" in message and "more than the model's 16 (max_position_embeddings 16)" in message
    scaled = llama3_recipe(llama3_data, "model.config.max_position_embeddings=16",
                           "model.config.rope_scaling={rope_type: linear, factor: 4.0}")  # 64 positions
    checks.preflight(scaled, 2, tokenizer=llama3_data["tokenizer"])
    message = refused(llama3_data, llama3_recipe(llama3_data, "data.seq_len=256"))
    assert "data.seq_len: 256 is more than the model's 128 positions" in message


def test_a_label_outside_the_vocabulary_names_shard_row_and_position(llama3_data, tmp_path):
    def plant(file, rows):
        if file == "shard-00001.parquet":
            rows[3]["labels"][5] = VOCAB + 7
        return rows

    data = _copy_with(llama3_data, tmp_path, plant)
    record = _rows(data / "shard-00001.parquet")[3]["record"]
    message = refused(llama3_data, llama3_recipe(llama3_data, data=data))
    assert (f"data.train: label {VOCAB + 7} at {data}/shard-00001.parquet row 3 (record {record}), position 5 is "
            f"outside the model's vocabulary [0, {VOCAB})") in message


def test_a_row_whose_labels_are_one_short_is_refused_naming_it(llama3_data, tmp_path):
    def shorten(file, rows):
        if file == "shard-00000.parquet":
            rows[2]["labels"].pop()
        return rows

    data = _copy_with(llama3_data, tmp_path, shorten)
    n = len(_rows(data / "shard-00000.parquet")[2]["input_ids"])
    message = refused(llama3_data, llama3_recipe(llama3_data, data=data))
    assert (f"{data}/shard-00000.parquet row 2 (record {_rows(data / 'shard-00000.parquet')[2]['record']}): its "
            f"per-token columns differ in length (input_ids {n}, labels {n - 1}, num_tokens {n}, numeric_mask {n})"
            in message)


def test_data_without_a_scored_label_is_refused(llama3_data, tmp_path):
    def unlabel(file, rows):
        for r in rows:
            r["labels"] = [-100] * len(r["labels"])
        return rows

    message = refused(llama3_data, llama3_recipe(llama3_data, data=_copy_with(llama3_data, tmp_path, unlabel)))
    assert "data.train: no row of" in message and "has a scored label" in message


def test_a_manifest_without_statistics_is_scanned_or_refused_with_the_command(llama3_data, tmp_path, monkeypatch):
    """Data built before the statistics: scanned at start-up (a line per shard) and checked the same; above
    the scan limit, refused naming the one command that records them."""
    data = tmp_path / "old"
    shutil.copytree(llama3_data["data"], data)
    manifest = json.loads((data / "manifest.json").read_text())
    for shard in manifest["shards"]:
        del shard["stats"]
    (data / "manifest.json").write_text(json.dumps(manifest))
    said: list[str] = []
    lines = checks.preflight(llama3_recipe(llama3_data, data=data), 2, tokenizer=llama3_data["tokenizer"],
                             say=said.append)
    shards = len(manifest["shards"])
    assert any("no per-shard token statistics" in line and f"scanned its {shards} shards" in line
               and f"`python -m data_prep stats {data}` records them once" in line for line in lines), lines
    assert len(said) == shards and all(line.startswith(f"scanning {data}/shard-") for line in said)
    assert "data.seq_len: 8 is shorter than the longest row" in refused(
        llama3_data, llama3_recipe(llama3_data, "data.seq_len=8", data=data))
    monkeypatch.setattr(data_checks, "SCAN_LIMIT_BYTES", 0)
    assert f"run `python -m data_prep stats {data}` once" in refused(llama3_data, llama3_recipe(llama3_data, data=data))
    assert "stats" not in json.loads((data / "manifest.json").read_text())["shards"][0]  # never written here
