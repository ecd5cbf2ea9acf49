"""Per-shard token statistics: what a training run checks against the model before building it.

The build writes them into each shard's manifest entry (`"stats"`), computed from the rows as they are
written, so a run's checks (`recipes.checks.data_checks`) read a few numbers per shard instead of the
data, at 1 TB as at 1 MB:

    tokens_max      {value, row[, record]}             the longest row (input_ids)
    positions_max   {value, row[, record]}             the most positions a row uses (packed: its longest
                                                       example, position_ids + 1; unpacked: its length)
    input_id_min / input_id_max   {value, row, position[, record]}
    label_min / label_max         {value, row, position[, record]} over the labels that are not -100
                                                       (null when every label is -100)
    scored_labels   labels that are not -100 at position >= 1 of their row: the loss shifts by one, so
                    the label at a row's first position is never predicted
    length_mismatch null, or the first row whose per-token columns (input_ids, labels, numeric_mask;
                    packed: position_ids, segment_ids) or num_tokens disagree in length:
                    {row, lengths: {column: n}[, record]}

`row` counts the shard's rows from 0 (Parquet order); `record` is the build's input record (unpacked rows;
in a packed row the record of the example at `position`). Manifests written before these statistics
have none: `ensure_stats` computes them by one pass over the shards' token columns, and `python -m
data_prep stats DIR` writes them into the manifest once (`write_stats`).
"""

from __future__ import annotations

import os
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .shards import MANIFEST, atomic_write_json, read_manifest
from .tokenize import IGNORE_INDEX

# per-token list columns: one entry per token of the row, so every one has the row's length
TOKEN_COLUMNS = ("input_ids", "labels", "numeric_mask", "position_ids", "segment_ids")
_READ = TOKEN_COLUMNS + ("num_tokens", "record", "records")


def _column(rows, name: str):
    col = rows.column(name)
    return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col


def _lengths(col) -> np.ndarray:
    return pc.list_value_length(col).to_numpy(zero_copy_only=False).astype(np.int64)


def _flat(col) -> np.ndarray:
    return col.flatten().to_numpy(zero_copy_only=False)


class _Rows:
    """The rows of one table or batch, with the lookups the statistics name a place by."""

    def __init__(self, rows, first_row: int):
        self.rows, self.first = rows, first_row
        self.names = set(rows.schema.names)
        self.ids = _column(rows, "input_ids")
        self.offsets = np.concatenate([[0], np.cumsum(_lengths(self.ids))])
        self.packed = "records" in self.names

    def place(self, flat: int | None = None, row: int | None = None) -> dict:
        """{row[, position][, record]} of a flat token index (or of a row)."""
        if row is None:
            row = int(np.searchsorted(self.offsets, flat, side="right") - 1)
        out = {"row": self.first + row}
        if flat is not None:
            out["position"] = int(flat - self.offsets[row])
        if "record" in self.names:
            out["record"] = int(_column(self.rows, "record")[row].as_py())
        elif self.packed and flat is not None and "segment_ids" in self.names:
            segment = int(_flat(_column(self.rows, "segment_ids"))[flat])
            records = _column(self.rows, "records")[row].as_py()
            if 1 <= segment <= len(records):
                out["record"] = int(records[segment - 1])
        return out

    def extreme(self, values: np.ndarray, where: np.ndarray | None, pick: Callable) -> dict | None:
        """{value, row, position[, record]} of the min / max (`pick`: np.argmin / np.argmax) of the flat
        `values`, over the entries `where` is true (all when None); None when there are none."""
        index = np.arange(len(values)) if where is None else np.flatnonzero(where)
        if not len(index):
            return None
        i = int(index[pick(values[index])])
        return {"value": int(values[i]), **self.place(flat=i)}


def token_stats(rows: pa.Table | pa.RecordBatch, first_row: int = 0) -> dict | None:
    """The statistics of the module docstring for `rows` (shard rows `first_row`, `first_row` + 1, ...);
    None for no rows."""
    if rows.num_rows == 0:
        return None
    r = _Rows(rows, first_row)
    lengths = {name: _lengths(_column(rows, name)) for name in TOKEN_COLUMNS if name in r.names}
    if "num_tokens" in r.names:
        lengths["num_tokens"] = _column(rows, "num_tokens").to_numpy(zero_copy_only=False).astype(np.int64)
    ids_len = lengths["input_ids"]
    bad = np.zeros(len(ids_len), dtype=bool)
    for n in lengths.values():
        bad |= n != ids_len
    mismatch = None
    if bad.any():
        row = int(np.argmax(bad))
        mismatch = {**r.place(row=row), "lengths": {k: int(v[row]) for k, v in lengths.items()}}
    longest = int(np.argmax(ids_len))
    tokens_max = {"value": int(ids_len[longest]), **r.place(row=longest)}
    positions_max = tokens_max
    if "position_ids" in r.names and not bad.any():
        pos = _flat(_column(rows, "position_ids")).astype(np.int64)
        if len(pos):
            at = r.extreme(pos, None, np.argmax)
            positions_max = {**at, "value": at["value"] + 1}
            positions_max.pop("position", None)
    ids = _flat(r.ids).astype(np.int64)
    out = {"tokens_max": tokens_max, "positions_max": positions_max,
           "input_id_min": r.extreme(ids, None, np.argmin), "input_id_max": r.extreme(ids, None, np.argmax),
           "label_min": None, "label_max": None, "scored_labels": 0, "length_mismatch": mismatch}
    if "labels" in r.names and not bad.any():
        labels = _flat(_column(rows, "labels")).astype(np.int64)
        scored = labels != IGNORE_INDEX
        out["label_min"] = r.extreme(labels, scored, np.argmin)
        out["label_max"] = r.extreme(labels, scored, np.argmax)
        first = np.zeros(len(labels), dtype=bool)
        first[r.offsets[:-1][ids_len > 0]] = True  # each row's position 0: never predicted
        out["scored_labels"] = int((scored & ~first).sum())
    return out


def merge_stats(a: dict | None, b: dict | None) -> dict | None:
    """The statistics of two row ranges together (`a`'s rows first)."""
    if a is None or b is None:
        return a if b is None else b

    def pick(key: str, better: Callable[[int, int], bool]):
        x, y = a[key], b[key]
        if x is None or y is None:
            return x if y is None else y
        return y if better(y["value"], x["value"]) else x

    return {"tokens_max": pick("tokens_max", lambda y, x: y > x),
            "positions_max": pick("positions_max", lambda y, x: y > x),
            "input_id_min": pick("input_id_min", lambda y, x: y < x),
            "input_id_max": pick("input_id_max", lambda y, x: y > x),
            "label_min": pick("label_min", lambda y, x: y < x), "label_max": pick("label_max", lambda y, x: y > x),
            "scored_labels": a["scored_labels"] + b["scored_labels"],
            "length_mismatch": a["length_mismatch"] or b["length_mismatch"]}


def scan_shard(path: str) -> dict | None:
    """A shard file's statistics, read row group by row group (the token columns only)."""
    f = pq.ParquetFile(path)
    columns = [c for c in _READ if c in f.schema_arrow.names]
    stats, first = None, 0
    for g in range(f.metadata.num_row_groups):
        table = f.read_row_group(g, columns=columns)
        stats = merge_stats(stats, token_stats(table, first))
        first += table.num_rows
    return stats


# every statistic a shard entry carries (its `stats` is null only for a shard of no rows)
STAT_KEYS = ("tokens_max", "positions_max", "input_id_min", "input_id_max", "label_min", "label_max",
             "scored_labels", "length_mismatch")


def missing_stats(manifest: dict) -> list[dict]:
    """The manifest's shard entries without statistics (a build from before they were recorded), or with
    only some of them (a hand-edited or cut manifest): these are computed again from the shard."""
    return [s for s in manifest.get("shards", [])
            if "stats" not in s or (s["stats"] is not None and not all(k in s["stats"] for k in STAT_KEYS))]


def ensure_stats(data_dir: str, manifest: dict, progress: Callable[[str], None] | None = None) -> list[dict]:
    """Fill in `stats` of every shard entry of `manifest` that has none, by one pass over its token
    columns (`progress(line)` before each shard); returns the entries it filled. The manifest file is
    not written (`write_stats` does)."""
    todo = missing_stats(manifest)
    for i, shard in enumerate(todo):
        if progress is not None:
            progress(f"scanning {os.path.join(data_dir, shard['file'])} ({i + 1}/{len(todo)}, {shard['bytes']:,} B)")
        shard["stats"] = scan_shard(os.path.join(data_dir, shard["file"]))
    return todo


def write_stats(data_dir: str, progress: Callable[[str], None] | None = None) -> int:
    """`python -m data_prep stats DIR`: the statistics of every shard that has none written into DIR's
    manifest (atomically: a temporary file renamed over it); returns how many shards were scanned."""
    manifest = read_manifest(data_dir)
    filled = ensure_stats(data_dir, manifest, progress)
    if filled:
        atomic_write_json(os.path.join(data_dir, MANIFEST), manifest)
    return len(filled)
