"""Per-shard token statistics (`data_prep.stats`): written by the build, equal to a plain-Python count over
the shards' rows; recomputed for a manifest without them (`python -m data_prep stats`); a shard whose
per-token columns disagree is flagged, and the reader refuses its row (and a row past data.seq_len)
naming shard, row group, row and record."""

from __future__ import annotations

import json
import os
import re
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_prep import BuildConfig, ShardConfig, SourceConfig, TokenizeConfig, build
from data_prep.__main__ import main as data_prep_main
from data_prep.reader import DataError, ShardDataset
from data_prep.stats import scan_shard


@pytest.fixture(scope="module", params=[None, 40], ids=["unpacked", "packed"])
def built(request, tmp_path_factory, digits_tok):
    out = str(tmp_path_factory.mktemp("stats") / "data")
    manifest = build(BuildConfig(sources=[SourceConfig("arithmetic", options={"n": 40, "max_digits": 3})],
                                 tokenize=TokenizeConfig(digits_tok, max_length=40),
                                 shards=ShardConfig(shard_bytes=3000, row_group_rows=8, pack_length=request.param)),
                     out, workers=0, progress=False)
    return out, manifest


def _by_hand(rows: list[dict]) -> dict:
    """The statistics' values counted row by row in plain Python (the independent reference)."""
    lengths = [len(r["input_ids"]) for r in rows]
    labels = [(lab, i, p) for i, r in enumerate(rows) for p, lab in enumerate(r["labels"]) if lab != -100]
    ids = [(t, i, p) for i, r in enumerate(rows) for p, t in enumerate(r["input_ids"])]
    positions = [max(r["position_ids"]) + 1 if "position_ids" in r else len(r["input_ids"]) for r in rows]
    return {"tokens_max": (max(lengths), lengths.index(max(lengths))), "positions_max": max(positions),
            "label_max": max(labels)[0], "label_min": min(labels)[0], "input_id_max": max(ids)[0],
            "input_id_min": min(ids)[0], "scored_labels": sum(1 for _, _, p in labels if p >= 1)}


def test_the_build_writes_each_shards_statistics(built):
    out, manifest = built
    assert len(manifest["shards"]) > 1
    for shard in manifest["shards"]:
        rows = pq.read_table(os.path.join(out, shard["file"])).to_pylist()
        st, ref = shard["stats"], _by_hand(rows)
        assert (st["tokens_max"]["value"], st["tokens_max"]["row"]) == ref["tokens_max"]
        assert st["positions_max"]["value"] == ref["positions_max"]
        for key in ("label_max", "label_min", "input_id_max", "input_id_min"):
            assert st[key]["value"] == ref[key], key
            row, position = st[key]["row"], st[key]["position"]  # the place named holds that value
            column = "labels" if key.startswith("label") else "input_ids"
            assert rows[row][column][position] == ref[key]
        assert st["scored_labels"] == ref["scored_labels"] > 0
        assert st["length_mismatch"] is None
        assert scan_shard(os.path.join(out, shard["file"])) == st  # a later scan: the same numbers


def test_stats_command_fills_an_old_manifest(built, tmp_path):
    out, manifest = built
    old = tmp_path / "old"
    shutil.copytree(out, old)
    stripped = json.loads((old / "manifest.json").read_text())
    for shard in stripped["shards"]:
        del shard["stats"]
    (old / "manifest.json").write_text(json.dumps(stripped))
    assert data_prep_main(["stats", str(old)]) == 0
    filled = json.loads((old / "manifest.json").read_text())
    assert [s["stats"] for s in filled["shards"]] == [s["stats"] for s in manifest["shards"]]
    assert data_prep_main(["stats", str(old)]) == 0  # nothing left to do


def test_a_shard_entry_with_only_some_statistics_is_scanned_again(built, tmp_path):
    """A hand-edited or cut manifest: an entry that lost `scored_labels` is computed again, not read as a
    KeyError by the run's checks."""
    from data_prep.stats import ensure_stats, missing_stats
    from recipes.checks.data_checks import ensure_statistics

    out, manifest = built
    cut = json.loads(json.dumps(manifest))
    del cut["shards"][0]["stats"]["scored_labels"]
    assert missing_stats(cut) == [cut["shards"][0]]
    errors, warnings = ensure_statistics(cut, out)
    assert errors == [] and "scanned its 1 shards" in warnings[0]
    assert cut["shards"][0]["stats"] == manifest["shards"][0]["stats"] and missing_stats(cut) == []
    assert ensure_stats(out, cut) == []


def _rewrite_row(data_dir, shard: dict, row: int, change) -> None:
    """Rewrite one row of a shard (`change(row_dict)`), keeping its row groups; the manifest's size follows
    (the reader's default check is the size), as if another tool had written the shard."""
    path = os.path.join(data_dir, shard["file"])
    f = pq.ParquetFile(path)
    rows = f.read().to_pylist()
    change(rows[row])
    pq.write_table(pa.Table.from_pylist(rows, schema=f.schema_arrow), path,
                   row_group_size=f.metadata.row_group(0).num_rows)
    manifest = json.loads((data_dir / "manifest.json").read_text())
    for s in manifest["shards"]:
        if s["file"] == shard["file"]:
            s["bytes"] = os.path.getsize(path)
    (data_dir / "manifest.json").write_text(json.dumps(manifest))


def test_a_row_whose_columns_disagree_is_flagged_and_refused_by_the_reader(built, tmp_path):
    out, manifest = built
    data = tmp_path / "bad"
    shutil.copytree(out, data)
    shard = max(manifest["shards"], key=lambda s: s["rows"])
    row = shard["rows"] - 1  # the shard's last row: row group row // 8 (8 rows a group), its row row % 8
    _rewrite_row(data, shard, row, lambda r: r["labels"].pop())
    st = scan_shard(str(data / shard["file"]))
    assert st["length_mismatch"]["row"] == row
    lengths = st["length_mismatch"]["lengths"]
    assert lengths["labels"] == lengths["input_ids"] - 1
    reader = ShardDataset(str(data), batch_size=4, shuffle=False, drop_last=False)
    with pytest.raises(DataError) as err:
        list(reader)
    m = re.search(r"(shard-\d+\.parquet): row group (\d+), row (\d+) \(record (\d+)\): its per-token columns differ "
                  r"in length \(input_ids (\d+), labels (\d+)", str(err.value))
    assert m, str(err.value)
    assert (m[1], int(m[2]), int(m[3])) == (shard["file"], row // 8, row % 8)
    assert int(m[6]) == int(m[5]) - 1


def test_a_row_longer_than_seq_len_is_refused_naming_it(built):
    out, manifest = built
    longest = max(manifest["shards"], key=lambda s: s["stats"]["tokens_max"]["value"])
    n, row = longest["stats"]["tokens_max"]["value"], longest["stats"]["tokens_max"]["row"]
    reader = ShardDataset(out, batch_size=4, shuffle=False, drop_last=False, seq_len=n - 1)
    with pytest.raises(DataError) as err:
        list(reader)
    m = re.search(r"(shard-\d+\.parquet): row group (\d+), row (\d+) \(record \d+\) has (\d+) tokens, more than "
                  rf"data.seq_len {n - 1}", str(err.value))
    assert m and int(m[4]) == n, str(err.value)
    f = pq.ParquetFile(os.path.join(out, m[1]))  # the row named is one of n tokens
    assert len(f.read_row_group(int(m[2])).column("input_ids")[int(m[3])].as_py()) == n
    assert sum(len(b["input_ids"]) for b in ShardDataset(out, batch_size=4, shuffle=False, drop_last=False,
                                                         seq_len=n)) == manifest["totals"]["rows"]
