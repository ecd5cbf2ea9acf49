"""Shard files, the progress file that makes a build resumable, and the manifest.

Layout of an output directory:

    shard-00000.parquet ...   the data (tokenize.ROW_SCHEMA, or pack.PACKED_SCHEMA when packed)
    rejects.jsonl             one line per rejected record: record, example_id, reason, detail
    manifest.json             written last: its presence means the build is complete
    _progress.json            during a build only: the parts finished so far
    _rejects/part-00000.jsonl during a build only: the rejects of each part

Decisions:
- A *part* is a contiguous range of input records [start, end_record): its kept rows become one shard
  (none if all were rejected) and its rejects one rejects part. A part closes after the first record
  that brings its estimated uncompressed size to `shard_bytes`, so boundaries depend on the input and
  the config only, never on worker timing or on where a previous run stopped.
- Every file is written under a temporary name and renamed; `_progress.json` is rewritten (also
  by rename) after each part, and `manifest.json` after everything else. On resume each recorded part
  is checked against its sha256; the build continues after the last good part and overwrites anything
  later, so an interrupted build ends with exactly the bytes of an uninterrupted one.
- Parquet bytes are reproducible: fixed compression, level and row-group size, statistics on, no
  timestamps anywhere (pyarrow writes only its "created_by" version and the Arrow schema). The same
  pyarrow version, input and config give byte-identical shards; the manifest records the version.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
PROGRESS = "_progress.json"
REJECTS = "rejects.jsonl"
REJECT_PARTS = "_rejects"


@dataclass
class ShardConfig:
    """How rows are grouped into files.

    shard_bytes: target uncompressed size of a shard (token columns + images), the part closes at or
        just past it. Small values make many small shards (tests); 256 MiB suits training.
    row_group_rows: rows per Parquet row group (the reader's unit of I/O).
    pack_length: pack examples into rows of at most this many tokens (None: one example per row).
    max_open_rows: how many partly filled packed rows the packer keeps open (see pack.py).
    """

    shard_bytes: int = 256 << 20
    row_group_rows: int = 1024
    compression: str = "zstd"
    compression_level: int = 3
    pack_length: int | None = None
    max_open_rows: int = 64


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.parquet"


def reject_part_name(index: int) -> str:
    return os.path.join(REJECT_PARTS, f"part-{index:05d}.jsonl")


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def atomic_write_bytes(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def atomic_write_json(path: str, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def _writer_options(cfg: ShardConfig) -> dict[str, Any]:
    """Fixed, reproducible Parquet writer options."""
    return {
        "compression": cfg.compression,
        "compression_level": cfg.compression_level,
        "use_dictionary": False,  # token lists do not repeat; dictionaries only cost time
        "write_statistics": True,
        "data_page_version": "1.0",
        "write_page_index": False,
    }


def write_shard(table: pa.Table, path: str, cfg: ShardConfig) -> None:
    """Write `table` to `path` (via a temporary file) with fixed, reproducible writer options."""
    tmp = path + ".tmp"
    pq.write_table(table, tmp, row_group_size=cfg.row_group_rows, **_writer_options(cfg))
    os.replace(tmp, path)


class ShardWriter:
    """A shard written row group by row group while its rows arrive (to `path`.tmp, renamed on close).

    The bytes equal `write_shard(pa.Table.from_batches(batches))` of all the batches written: each row
    group is written from the same slice of the same chunks (the Parquet writer's pages follow the
    chunk boundaries, so the chunks are kept as they come, never combined).
    """

    def __init__(self, path: str, schema: pa.Schema, cfg: ShardConfig):
        self.path, self.tmp = path, path + ".tmp"
        self.schema, self.group = schema, cfg.row_group_rows
        self.writer = pq.ParquetWriter(self.tmp, schema, **_writer_options(cfg))
        self.pending: list[pa.RecordBatch] = []
        self.pending_rows = 0

    def write(self, batch: pa.RecordBatch) -> None:
        self.pending.append(batch)
        self.pending_rows += batch.num_rows
        if self.pending_rows < self.group:
            return
        table = pa.Table.from_batches(self.pending, schema=self.schema)
        done = (table.num_rows // self.group) * self.group
        for start in range(0, done, self.group):
            self.writer.write_table(table.slice(start, self.group), row_group_size=self.group)
        rest = table.slice(done)
        self.pending = rest.to_batches()
        self.pending_rows = rest.num_rows

    def abort(self) -> None:
        """Stop without a shard: the writer is closed and its temporary file removed."""
        self.writer.close()
        if os.path.exists(self.tmp):
            os.remove(self.tmp)

    def close(self) -> None:
        try:
            if self.pending_rows:
                self.writer.write_table(pa.Table.from_batches(self.pending, schema=self.schema),
                                        row_group_size=self.group)
        finally:
            self.writer.close()
        os.replace(self.tmp, self.path)


def write_rejects(rejects: list[dict], path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write_bytes(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rejects).encode())


def load_progress(out_dir: str) -> dict | None:
    path = os.path.join(out_dir, PROGRESS)
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        return json.load(fh)


def verified_parts(out_dir: str, parts: list[dict]) -> list[dict]:
    """The longest prefix of `parts` whose files are all present with their recorded checksums."""
    good = []
    for part in parts:
        files = [(part["rejects_file"], part["rejects_sha256"])]
        if part["shard"] is not None:
            files.append((part["shard"]["file"], part["shard"]["sha256"]))
        ok = all(os.path.exists(os.path.join(out_dir, f)) and sha256_file(os.path.join(out_dir, f)) == s
                 for f, s in files)
        if not ok:
            break
        good.append(part)
    return good


def remove_stale(out_dir: str, keep: set[str]) -> None:
    """Delete shard/reject-part/temporary files a previous run left that are not in `keep`."""
    for d in (out_dir, os.path.join(out_dir, REJECT_PARTS)):
        if not os.path.isdir(d):
            continue
        for name in os.listdir(d):
            rel = os.path.relpath(os.path.join(d, name), out_dir)
            stale = name.endswith(".tmp") or (
                (name.startswith("shard-") or name.startswith("part-")) and rel not in keep)
            if stale:
                os.remove(os.path.join(d, name))


def finish(out_dir: str, parts: list[dict], header: dict) -> dict:
    """Concatenate the rejects parts, write the manifest (last), and clean up build-only files."""
    rej_path = os.path.join(out_dir, REJECTS)
    tmp = rej_path + ".tmp"
    h = hashlib.sha256()
    with open(tmp, "wb") as out:
        for p in parts:
            with open(os.path.join(out_dir, p["rejects_file"]), "rb") as fh:
                data = fh.read()
            h.update(data)
            out.write(data)
    os.replace(tmp, rej_path)

    by_reason: dict[str, int] = {}
    for p in parts:
        for reason, n in p["rejects_by_reason"].items():
            by_reason[reason] = by_reason.get(reason, 0) + n
    shards = [p["shard"] for p in parts if p["shard"] is not None]
    kept = sum(s["examples"] for s in shards)
    rejected = sum(by_reason.values())
    read = parts[-1]["end_record"] if parts else 0
    if read != kept + rejected:  # cannot happen unless the builder has a bug: never write such a manifest
        raise RuntimeError(f"counts do not reconcile: read {read} != kept {kept} + rejected {rejected}")
    manifest = {
        **header,
        "schema_version": SCHEMA_VERSION,
        "pyarrow_version": pa.__version__,
        "shards": shards,
        "totals": {
            "records_read": read,
            "examples_kept": kept,
            "rejected": rejected,
            "rows": sum(s["rows"] for s in shards),
            "tokens": sum(s["tokens"] for s in shards),
            "label_tokens": sum(s["label_tokens"] for s in shards),
            "numeric_tokens": sum(s["numeric_tokens"] for s in shards),
        },
        "rejects": {"file": REJECTS, "count": rejected, "by_reason": dict(sorted(by_reason.items())),
                    "sha256": h.hexdigest()},
    }
    atomic_write_json(os.path.join(out_dir, MANIFEST), manifest)
    # Build-only files go after the manifest exists; a crash here leaves a complete build.
    for p in parts:
        os.remove(os.path.join(out_dir, p["rejects_file"]))
    if os.path.isdir(os.path.join(out_dir, REJECT_PARTS)):
        os.rmdir(os.path.join(out_dir, REJECT_PARTS))
    os.remove(os.path.join(out_dir, PROGRESS))
    return manifest


def read_manifest(out_dir: str) -> dict:
    path = os.path.join(out_dir, MANIFEST)
    if not os.path.exists(path):
        hint = " (a build is in progress or was interrupted: rerun it)" if os.path.exists(
            os.path.join(out_dir, PROGRESS)) else ""
        raise FileNotFoundError(f"{out_dir}: no {MANIFEST}{hint}")
    with open(path) as fh:
        manifest = json.load(fh)
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"{path}: schema version {manifest.get('schema_version')}, this code reads "
                         f"{SCHEMA_VERSION}")
    return manifest
