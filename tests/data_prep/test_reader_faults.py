"""Issue 27: data faults name the shard file and the record (data_prep.reader.DataError).

Before: a truncated or corrupt shard gave pyarrow's `Parquet magic bytes not found` or `ZSTD
decompression failed` naming no file, and a label outside the vocabulary was reported mid-run by the
loss with a flat batch position."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_prep import BuildConfig, ShardConfig, SourceConfig, TokenizeConfig, build
from data_prep.reader import DataError, ShardDataset
from data_prep.shards import sha256_file


@pytest.fixture(scope="module")
def built(tmp_path_factory, digits_tok):
    out = tmp_path_factory.mktemp("faults") / "ds"
    build(BuildConfig(sources=[SourceConfig("arithmetic", options={"n": 40, "max_digits": 2})],
                      tokenize=TokenizeConfig(digits_tok), shards=ShardConfig(shard_bytes=3000, row_group_rows=8)),
          str(out), workers=0, progress=False)
    return out


@pytest.fixture
def data(built, tmp_path):
    copy = tmp_path / "ds"
    shutil.copytree(built, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    assert len(manifest["shards"]) >= 2
    return copy, manifest


def _read_all(path, **kw):
    return [b for b in ShardDataset(str(path), batch_size=4, shuffle=False, drop_last=False, **kw)]


def test_a_truncated_shard_is_named_at_open(data):
    path, manifest = data
    shard = path / manifest["shards"][1]["file"]
    shard.write_bytes(shard.read_bytes()[:-200])
    with pytest.raises(DataError, match=f"{shard}: .* bytes, the manifest records"):
        ShardDataset(str(path), batch_size=4)
    with pytest.raises(DataError, match=f"{shard}: not a readable Parquet file"):  # no size check: pyarrow's error
        ShardDataset(str(path), batch_size=4, verify="none")


def test_a_changed_shard_is_named_by_the_full_check(data):
    path, manifest = data
    shard = path / manifest["shards"][0]["file"]
    column = pq.ParquetFile(shard).metadata.row_group(0).column(0)
    raw = bytearray(shard.read_bytes())
    raw[column.data_page_offset + column.total_compressed_size - 1] ^= 0xFF  # one flipped data byte: same size
    shard.write_bytes(bytes(raw))
    ShardDataset(str(path), batch_size=4)  # the cheap check sees the size only
    with pytest.raises(DataError, match=f"{shard}: its sha256 differs from the manifest's"):
        ShardDataset(str(path), batch_size=4, verify="full")


def test_an_unreadable_row_group_is_named_with_its_file_and_rows(data):
    path, manifest = data
    shard = path / manifest["shards"][0]["file"]
    meta = pq.ParquetFile(shard).metadata
    column = meta.row_group(0).column(0)
    start = column.data_page_offset
    raw = bytearray(shard.read_bytes())
    raw[start:start + column.total_compressed_size] = b"\x00" * column.total_compressed_size
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=f"{shard}: row group 0 \\(rows 0-7 of the data\\) unreadable"):
        _read_all(path)


def test_a_label_outside_the_vocabulary_names_the_shard_row_and_record(data):
    path, manifest = data
    entry = manifest["shards"][1]
    shard = path / entry["file"]
    table = pq.read_table(shard)
    labels = table.column("labels").to_pylist()
    records = table.column("record").to_pylist()
    row = 3
    position = next(i for i, v in enumerate(labels[row]) if v != -100)
    vocab = manifest["tokenizer"]["length"]
    labels[row][position] = vocab + 5  # data built with a larger tokenizer
    table = table.set_column(table.schema.get_field_index("labels"), "labels",
                             pa.array(labels, type=table.schema.field("labels").type))
    pq.write_table(table, shard, row_group_size=8)
    entry.update(bytes=shard.stat().st_size, sha256=sha256_file(str(shard)))
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError) as err:
        _read_all(path)
    assert str(err.value) == (f"{shard}: row group 0, row {row} (record {records[row]}), position {position}: label "
                              f"{vocab + 5} outside the vocabulary [0, {vocab}) of the manifest's tokenizer")
    assert np.iinfo(np.int64).max > vocab  # (the check is on the int64 values as read)
