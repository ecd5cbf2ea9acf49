"""The build: sources -> worker processes (tokenize + annotate) -> parts -> shards + manifest.

Decisions:
- Streaming: the main process reads records lazily and hands them out in chunks of `chunk_size`;
  at most `2 * workers + 2` chunks are in flight, so memory is bounded by the chunks in flight plus
  one part (about `shard_bytes`), whatever the corpus size.
- Order: results are taken back in submission order (a deque of async results), so the output is
  the same for any number of workers and any timing; `workers=0` encodes in the main process.
- Records are numbered 0, 1, ... across the sources in order; rejects and shards cover contiguous
  ranges of these numbers, and records read = examples kept + rejected is checked before the
  manifest is written.
- Resume: a rerun with the same config finds `_progress.json`, verifies the finished parts by
  checksum, skips their records (they are still read, not encoded) and continues. A different
  config, tokenizer or input is refused rather than mixed in (use `overwrite=True`).
- `max_reject_fraction` guards against a misconfigured build (a wrong field name rejects every
  record): above it the build fails after writing the rejects, naming the top reasons, and writes
  no manifest.
- Workers (workers.py): they start first, and while they load the tokenizer the main process hashes
  the input; the header (tokenizer and numeric vocabulary) comes from a worker, so the main process
  never loads the tokenizer itself. A watchdog fails a build whose workers return nothing for
  `stall_timeout` seconds (a worker hung, in its set-up or on a chunk, or was killed: a pool never
  returns a lost task) with a TimeoutError naming the part and the records it waited for, instead of
  hanging. Finished parts are kept; a rerun resumes after them.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import multiprocessing as mp
import os
import shutil
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import shards as S
from .pack import pack_table
from .stats import merge_stats, token_stats
from .sources import SourceConfig, make_source
from .tokenize import IGNORE_INDEX, Encoder, TokenizeConfig
from .tokenizer_check import tokenizer_problem
from .workers import DEFAULT_STALL_TIMEOUT, Stalled, start_encoding


@dataclass
class BuildConfig:
    """Everything that decides the bytes of the output (workers and paths of the output do not)."""

    sources: list[SourceConfig]
    tokenize: TokenizeConfig
    shards: S.ShardConfig = field(default_factory=S.ShardConfig)
    max_reject_fraction: float = 0.5

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["tokenize"].pop("allow_unk")  # decides whether a build runs, not its bytes: not its identity
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "BuildConfig":
        return cls(sources=[SourceConfig(**s) for s in d["sources"]],
                   tokenize=TokenizeConfig(**d["tokenize"]),
                   shards=S.ShardConfig(**d.get("shards", {})),
                   max_reject_fraction=d.get("max_reject_fraction", 0.5))


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


# ---- main side ---------------------------------------------------------------------------------
class _Part:
    """Rows and rejects of the part being filled.

    Unpacked rows go straight into the part's shard file, a row group at a time, so the shard is
    written while the workers encode instead of all at once when the part closes; packed parts keep
    their rows until then (packing needs them all).
    """

    def __init__(self, index: int, out_dir: str, cfg: S.ShardConfig):
        self.index = index
        self.out_dir, self.cfg = out_dir, cfg
        self.pieces: list[pa.RecordBatch] = []  # packed parts only
        self.rejects: list[dict] = []
        self.bytes = 0
        self.writer: S.ShardWriter | None = None
        self.rows = self.tokens = self.label_tokens = self.numeric_tokens = 0
        self.stats: dict | None = None  # data_prep.stats of the rows written so far (unpacked parts)

    def add(self, piece: pa.RecordBatch) -> None:
        if not piece.num_rows:
            return
        if self.cfg.pack_length is not None:
            self.pieces.append(piece)
            return
        if self.writer is None:
            self.writer = S.ShardWriter(os.path.join(self.out_dir, S.shard_name(self.index)), piece.schema,
                                        self.cfg)
        self.writer.write(piece)
        self.stats = merge_stats(self.stats, token_stats(piece, first_row=self.rows))
        self.rows += piece.num_rows
        tokens, label_tokens, numeric_tokens = _token_counts(piece)
        self.tokens += tokens
        self.label_tokens += label_tokens
        self.numeric_tokens += numeric_tokens

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()


def _int_sum(arr) -> int:
    return int(pc.sum(arr).as_py() or 0)


def _token_counts(rows: pa.RecordBatch | pa.Table) -> tuple[int, int, int]:
    """(tokens, label tokens, numeric tokens) of shard rows, packed or not: the manifest's counts."""
    labels = pc.list_flatten(rows.column("labels"))
    return (_int_sum(rows.column("num_tokens")), _int_sum(pc.not_equal(labels, IGNORE_INDEX)),
            _int_sum(pc.list_flatten(rows.column("numeric_mask"))))


def _np(arr: pa.Array, dtype) -> np.ndarray:
    """A null-free fixed-width array as numpy (Array.to_numpy imports pandas, ~0.3 s)."""
    return np.frombuffer(arr.buffers()[1], dtype=dtype)[arr.offset:arr.offset + len(arr)]


def _row_bytes(batch: pa.RecordBatch) -> np.ndarray:
    """Estimated uncompressed bytes per row: what the shard size target counts."""
    n_tok = _np(batch.column("num_tokens"), np.int32).astype(np.int64)
    image = batch.column("image")  # binary: lengths from the offsets, 0 where null
    offs = np.frombuffer(image.buffers()[1], dtype=np.int32)[image.offset:image.offset + len(image) + 1]
    img = np.diff(offs).astype(np.int64)
    if image.null_count:
        bits = np.unpackbits(np.frombuffer(image.buffers()[0], dtype=np.uint8), bitorder="little")
        img[~bits[image.offset:image.offset + len(image)].astype(bool)] = 0
    return 9 * n_tok + img + 64


class Builder:
    """One build. `workers`: encoding processes (0: encode in this process); `start_method`: how they
    start (default "forkserver", else "spawn"; see workers.py); `stall_timeout`: seconds without any
    task coming back before the build fails (None: wait forever)."""

    def __init__(self, cfg: BuildConfig, out_dir: str, workers: int = 2, chunk_size: int = 256,
                 progress: bool = True, overwrite: bool = False, start_method: str | None = None,
                 stall_timeout: float | None = DEFAULT_STALL_TIMEOUT):
        self.cfg, self.out_dir = cfg, out_dir
        self.workers, self.chunk_size = workers, chunk_size
        self.progress, self.overwrite = progress, overwrite
        methods = mp.get_all_start_methods()
        self.start_method = start_method or ("forkserver" if "forkserver" in methods else "spawn")
        if self.start_method not in methods:
            raise ValueError(f"start_method {self.start_method!r} is not available here; one of {methods}")
        if stall_timeout is not None and not stall_timeout > 0:
            raise ValueError(f"stall_timeout must be > 0 seconds or None, got {stall_timeout}")
        self.stall_timeout = stall_timeout
        sc = cfg.shards
        if sc.pack_length is not None and cfg.tokenize.max_length > sc.pack_length:
            raise ValueError(f"max_length {cfg.tokenize.max_length} > pack_length {sc.pack_length}: "
                             "an example must fit in a packed row")
        self.sources = [make_source(s) for s in cfg.sources]
        if sc.pack_length is not None and any(s.has_images for s in self.sources):
            raise ValueError("packing is for text: a source with images cannot be packed")

    # The identity of a build: what a resume must match.
    def header(self) -> dict:
        """The header, computed in this process (it loads the tokenizer)."""
        return self._header(Encoder(self.cfg.tokenize).describe(), [s.fingerprint() for s in self.sources])

    def _header(self, described: dict, sources: list[dict]) -> dict:
        """described: `Encoder.describe()` of the build's tokenize config; sources: their fingerprints."""
        cfg = self.cfg.to_dict()
        return {
            "format": "numloss.data_prep",
            "config": cfg,
            "config_fingerprint": _digest(cfg),
            "packed": self.cfg.shards.pack_length is not None,
            "tokenizer": described["tokenizer"],
            "numeric_vocab": described["numeric_vocab"],
            "sources": sources,
        }

    def _records(self, start: int) -> Iterator[tuple[int, int, str, Any]]:
        record = 0
        for si, src in enumerate(self.sources):
            for ref, raw in src.iter_raw():
                if record >= start:
                    yield record, si, ref, raw
                record += 1

    def _chunks(self, start: int) -> Iterator[list]:
        chunk = []
        for item in self._records(start):
            chunk.append(item)
            if len(chunk) == self.chunk_size:
                yield chunk
                chunk = []
        if chunk:
            yield chunk

    def run(self) -> dict:
        os.makedirs(self.out_dir, exist_ok=True)
        if not self.overwrite and os.path.exists(os.path.join(self.out_dir, S.MANIFEST)):
            done = S.read_manifest(self.out_dir)  # nothing to encode: no workers, the header here
            if _identity(done) == _identity(self.header()):
                return done  # already built: nothing to do
            raise FileExistsError(f"{self.out_dir} holds a finished build of a different config/input; "
                                  "pass overwrite=True (--overwrite) to replace it")
        # what is cheap to know first: the input files are there, the tokenizer can be reached from here
        for source in self.sources:
            source.check_input()
        problem = tokenizer_problem(self.cfg.tokenize.tokenizer, self.cfg.tokenize.revision)
        if problem:
            raise ValueError(problem)
        # The workers start now and load the tokenizer while this process hashes the input.
        with start_encoding(self.cfg.sources, self.cfg.tokenize, self.workers, self.start_method,
                            self.stall_timeout) as encoding:
            sources = [s.fingerprint() for s in self.sources]
            try:
                described = encoding.describe()
            except Stalled as e:
                raise TimeoutError(
                    f"data_prep build: no worker finished its set-up (loading the tokenizer "
                    f"{self.cfg.tokenize.tokenizer!r}) in {e.idle:.0f} s (stall_timeout); the workers were "
                    "stopped and nothing was written. If the workers could not start, the errors above "
                    f"say why{_MAIN_GUARD_HINT}") from None
            header = self._header(described, sources)
            parts = self._prepare(header)
            parts = self._encode(encoding, header, parts)
        self._check_rejects(parts)
        return S.finish(self.out_dir, parts, header)

    def _prepare(self, header: dict) -> list[dict]:
        """Clear the output (overwrite) or check and verify what a previous run of this build left
        (resume); return the finished parts to keep."""
        if self.overwrite:
            for name in os.listdir(self.out_dir):
                if name.startswith("shard-") or name in (S.MANIFEST, S.PROGRESS, S.REJECTS, S.REJECT_PARTS) \
                        or name.endswith(".tmp"):
                    p = os.path.join(self.out_dir, name)
                    shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
        parts: list[dict] = []
        progress = S.load_progress(self.out_dir)
        if progress is not None:
            if _identity(progress["header"]) != _identity(header):
                raise FileExistsError(f"{self.out_dir} holds an unfinished build of a different "
                                      "config/input; pass overwrite=True (--overwrite) to replace it")
            parts = S.verified_parts(self.out_dir, progress["parts"])
        keep = {p["rejects_file"] for p in parts} | {p["shard"]["file"] for p in parts if p["shard"]}
        S.remove_stale(self.out_dir, keep)
        self._save_progress(header, parts)
        return parts

    def _encode(self, encoding, header: dict, parts: list[dict]) -> list[dict]:
        """Encode the records after the finished `parts` and write them into parts; return all parts."""
        start = parts[-1]["end_record"] if parts else 0
        part = self._new_part(len(parts))
        next_record = start
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(unit="rec", desc="data_prep build", initial=start, dynamic_ncols=True)
        target = self.cfg.shards.shard_bytes
        try:
            for n, (batch, rejects) in encoding.results(self._chunks(start)):
                kept_records = _np(batch.column("record"), np.int64)
                # Running size of the part after each row; the part closes after the first row that
                # reaches the target (sizes are positive, so the running sums are increasing).
                running = part.bytes + np.cumsum(_row_bytes(batch))
                ri, lo = 0, 0
                while True:
                    i = lo + int(np.searchsorted(running[lo:], target, side="left"))
                    if i >= batch.num_rows:
                        break
                    end = int(kept_records[i]) + 1
                    while ri < len(rejects) and rejects[ri]["record"] < end:
                        part.rejects.append(rejects[ri])
                        ri += 1
                    part.add(batch.slice(lo, i + 1 - lo))
                    parts.append(self._close(part, end))
                    self._save_progress(header, parts)
                    part = self._new_part(len(parts))
                    running -= running[i]
                    lo = i + 1
                if batch.num_rows:
                    part.bytes = int(running[-1])
                part.add(batch.slice(lo))
                part.rejects.extend(rejects[ri:])
                next_record += n
                if bar is not None:
                    bar.update(n)
            if part.rows or part.pieces or part.rejects:
                parts.append(self._close(part, next_record))
                self._save_progress(header, parts)
        except Stalled as e:  # the workers are terminated when the build leaves the pool's context
            part.abort()
            raise TimeoutError(
                f"data_prep build stalled in part {part.index} ({S.shard_name(part.index)}): no worker "
                f"returned a chunk for {e.idle:.0f} s (stall_timeout) while the build waited for records "
                f"{e.first}-{e.last} (from {e.ref}). A worker hung or died (killed for memory?); the "
                f"workers were stopped. The {len(parts)} finished parts are kept: rerun to resume."
                + ("" if e.returned_any else
                   " No chunk came back at all: if the workers could not start, the errors above say why"
                   + _MAIN_GUARD_HINT)
            ) from None
        except BaseException:
            part.abort()
            raise
        if bar is not None:
            bar.close()
        return parts

    def _new_part(self, index: int) -> _Part:
        return _Part(index, self.out_dir, self.cfg.shards)

    def _close(self, part: _Part, end_record: int) -> dict:
        """Finish the part's shard and write its rejects; return its progress entry."""
        by_reason: dict[str, int] = {}
        for r in part.rejects:
            by_reason[r["reason"]] = by_reason.get(r["reason"], 0) + 1
        rej_file = S.reject_part_name(part.index)
        S.write_rejects(part.rejects, os.path.join(self.out_dir, rej_file))
        entry = {"index": part.index, "end_record": end_record, "rejects_file": rej_file,
                 "rejects_sha256": S.sha256_file(os.path.join(self.out_dir, rej_file)),
                 "rejects_by_reason": dict(sorted(by_reason.items())), "shard": None}
        name = S.shard_name(part.index)
        path = os.path.join(self.out_dir, name)
        if part.writer is not None:
            part.writer.close()
            entry["shard"] = {
                "file": name, "rows": part.rows, "examples": part.rows, "tokens": part.tokens,
                "label_tokens": part.label_tokens, "numeric_tokens": part.numeric_tokens,
                "bytes": os.path.getsize(path), "sha256": S.sha256_file(path), "stats": part.stats,
            }
        elif part.pieces:
            table = pa.Table.from_batches(part.pieces)
            examples = table.num_rows
            table = pack_table(table, self.cfg.shards.pack_length, self.cfg.shards.max_open_rows)
            S.write_shard(table, path, self.cfg.shards)
            tokens, label_tokens, numeric_tokens = _token_counts(table)
            entry["shard"] = {
                "file": name, "rows": table.num_rows, "examples": examples, "tokens": tokens,
                "label_tokens": label_tokens, "numeric_tokens": numeric_tokens,
                "bytes": os.path.getsize(path), "sha256": S.sha256_file(path), "stats": token_stats(table),
            }
        return entry

    def _save_progress(self, header: dict, parts: list[dict]) -> None:
        S.atomic_write_json(os.path.join(self.out_dir, S.PROGRESS), {"header": header, "parts": parts})

    def _check_rejects(self, parts: list[dict]) -> None:
        read = parts[-1]["end_record"] if parts else 0
        if read == 0:
            raise ValueError("no records were read: the sources are empty")
        by_reason: dict[str, int] = collections.Counter()
        for p in parts:
            by_reason.update(p["rejects_by_reason"])
        rejected = sum(by_reason.values())
        if rejected / read > self.cfg.max_reject_fraction:
            top = ", ".join(f"{k}: {v}" for k, v in by_reason.most_common(3))
            raise ValueError(
                f"{rejected} of {read} records rejected (> max_reject_fraction "
                f"{self.cfg.max_reject_fraction}); top reasons {top}; see the parts under "
                f"{os.path.join(self.out_dir, S.REJECT_PARTS)}")


_MAIN_GUARD_HINT = (" (a script that calls data_prep.build with workers needs `if __name__ == \"__main__\":`)")


def _identity(header: dict) -> tuple:
    return (header["config_fingerprint"], header["tokenizer"]["fingerprint"],
            _digest(header["sources"]))


def build(cfg: BuildConfig, out_dir: str, **kwargs) -> dict:
    """Build (or resume, or confirm) the shards of `cfg` in `out_dir`; returns the manifest."""
    return Builder(cfg, out_dir, **kwargs).run()
