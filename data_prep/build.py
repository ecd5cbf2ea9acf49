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
- Worker processes start with "forkserver" where the platform has it, else "spawn"; never "fork" by
  default. The main process has used torch's OpenMP thread pool (the numeric vocabulary of a 128k+
  token tokenizer is built with parallel torch ops) and the tokenizer's threads before the pool
  starts; a forked child inherits those pools without their threads, and its first parallel op waits
  forever (a build with a real tokenizer hung in every worker). A forkserver is a fresh interpreter
  that never ran a thread pool: it imports the heavy modules once (`_PRELOAD`) and forks each worker
  from that clean state, so workers start in about the time a fork takes plus loading the tokenizer.
  `start_method="fork"` is still accepted for callers that know their main process is single-threaded.
- Workers encode single-threaded (TOKENIZERS_PARALLELISM=false, one torch thread) so that `workers`
  processes use `workers` cores. With workers=0 the tokenizer's own threads are used.
- Watchdog: with workers, the main process waits for each chunk with a deadline. When no chunk has
  come back for `stall_timeout` seconds of waiting (a worker hung or was killed: a pool never returns
  a lost task), the build stops its workers and fails with a TimeoutError naming the part and the
  records it waited for, instead of hanging. Finished parts are kept; a rerun resumes after them.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import shards as S
from .pack import pack_table
from .sources import BadRecord, SourceConfig, make_source
from .tokenize import IGNORE_INDEX, Encoder, Item, TokenizeConfig, load_tokenizer, tokenizer_fingerprint


@dataclass
class BuildConfig:
    """Everything that decides the bytes of the output (workers and paths of the output do not)."""

    sources: list[SourceConfig]
    tokenize: TokenizeConfig
    shards: S.ShardConfig = field(default_factory=S.ShardConfig)
    max_reject_fraction: float = 0.5

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "BuildConfig":
        return cls(sources=[SourceConfig(**s) for s in d["sources"]],
                   tokenize=TokenizeConfig(**d["tokenize"]),
                   shards=S.ShardConfig(**d.get("shards", {})),
                   max_reject_fraction=d.get("max_reject_fraction", 0.5))


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


# ---- worker side -------------------------------------------------------------------------------
_WORKER: dict[str, Any] = {}

# What the forkserver imports once, before it forks workers: each worker then starts with them loaded
# (importing transformers and torch takes seconds per process otherwise). Importing starts no thread.
# "__main__" is what Python preloads by default: the caller's script, imported once, not per worker.
_PRELOAD = ["__main__", "data_prep.build", "numloss.vocab", "transformers",
            "transformers.models.auto.tokenization_auto"]

DEFAULT_STALL_TIMEOUT = 600.0


def _init_worker(cfg: BuildConfig, single_threaded: bool, environ: dict[str, str] | None = None) -> None:
    try:
        if environ is not None:  # the main process's environment now, as a fork would have it (a
            os.environ.clear()   # forkserver child has the environment the server started with)
            os.environ.update(environ)
        if single_threaded:
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
            import torch

            torch.set_num_threads(1)  # the numeric vocabulary's table ops: one core per worker
        _WORKER["sources"] = [make_source(s) for s in cfg.sources]
        _WORKER["encoder"] = Encoder(cfg.tokenize)
    except Exception as e:  # a Pool restarts a worker whose initializer raises, forever: report it instead
        _WORKER["error"] = f"worker set-up failed: {e}\n{traceback.format_exc()}"


def _encode_chunk(chunk: list[tuple[int, int, str, Any]]):
    """chunk: (record, source index, ref, raw) -> (rows RecordBatch, rejects)."""
    if "error" in _WORKER:
        raise RuntimeError(_WORKER["error"])
    try:
        sources, encoder = _WORKER["sources"], _WORKER["encoder"]
        items, rejects = [], []
        for record, si, ref, raw in chunk:
            src = sources[si]
            example_id = f"{src.kind}/{ref}"
            try:
                items.append(Item(record, example_id, src.to_example(raw, ref)))
            except BadRecord as e:
                rejects.append({"record": record, "example_id": example_id, "reason": e.reason,
                                "detail": e.detail})
        batch, too_long = encoder.encode(items)
        rejects = sorted(rejects + too_long, key=lambda r: r["record"])
        return batch, rejects
    except Exception as e:  # name the records, keep the traceback: pool errors are otherwise opaque
        first = chunk[0][2] if chunk else "?"
        raise RuntimeError(f"encoding records from {first} failed: {e}\n{traceback.format_exc()}") from None


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


class _Stalled(Exception):
    """No chunk came back for `idle` seconds while the main process waited for records first..last."""

    def __init__(self, first: int, last: int, ref: str, idle: float, returned_any: bool):
        super().__init__(f"records {first}-{last}")
        self.first, self.last, self.ref, self.idle = first, last, ref, idle
        self.returned_any = returned_any


class Builder:
    """One build. `workers`: encoding processes (0: encode in this process); `start_method`: how they
    start (default "forkserver", else "spawn"; see the module docstring); `stall_timeout`: seconds
    without any chunk coming back before the build fails (None: wait forever)."""

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
        tok = load_tokenizer(self.cfg.tokenize)
        enc = Encoder(self.cfg.tokenize, tokenizer=tok)
        cfg = self.cfg.to_dict()
        return {
            "format": "numloss.data_prep",
            "config": cfg,
            "config_fingerprint": _digest(cfg),
            "packed": self.cfg.shards.pack_length is not None,
            "tokenizer": {
                "name": self.cfg.tokenize.tokenizer,
                "fingerprint": tokenizer_fingerprint(tok),
                "length": len(tok),
                "pad_token_id": tok.pad_token_id,
                "bos_token_id": tok.bos_token_id,
                "eos_token_id": tok.eos_token_id,
                "template": enc.template.kind,
            },
            "numeric_vocab": {
                "policy": self.cfg.tokenize.numeric_policy,
                "size": enc.vocab.size,
                "token_ids": enc.vocab.token_ids.tolist(),
                "values": enc.vocab.values.tolist(),
            },
            "sources": [s.fingerprint() for s in self.sources],
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

    def _results(self, start: int):
        """Encoded chunks in input order, from `workers` processes with bounded look-ahead."""
        if self.workers <= 0:
            _init_worker(self.cfg, single_threaded=False)
            for chunk in self._chunks(start):
                yield len(chunk), _encode_chunk(chunk)
            return
        ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            ctx.set_forkserver_preload(_PRELOAD)  # no effect once this process's forkserver runs
        # (start_method "fork") Forked workers share the parent's pages until they write to them, and
        # the cyclic garbage collector writes to every object it visits: frozen objects are never
        # visited, so a worker's first collections do not copy the parent's heap (about 0.1 s per worker
        # with torch loaded).
        gc.freeze()
        try:
            pool = ctx.Pool(self.workers, initializer=_init_worker,
                            initargs=(self.cfg, True, dict(os.environ)))
        finally:
            gc.unfreeze()
        # When a chunk last came back, and how many have (set by the pool's result thread).
        last_return = [time.monotonic(), 0]

        def returned(_):
            last_return[0] = time.monotonic()
            last_return[1] += 1

        with pool:
            pending: collections.deque = collections.deque()

            def take():
                first, last, ref, n, res = pending.popleft()
                self._wait(res, last_return, first, last, ref)
                return n, res.get()

            for chunk in self._chunks(start):
                res = pool.apply_async(_encode_chunk, (chunk,), callback=returned, error_callback=returned)
                pending.append((chunk[0][0], chunk[-1][0], chunk[0][2], len(chunk), res))
                while len(pending) > 2 * self.workers + 2:
                    yield take()
            while pending:
                yield take()

    def _wait(self, res, last_return: list, first: int, last: int, ref: str) -> None:
        """Wait for `res` until no chunk has come back for `stall_timeout` seconds of this wait."""
        if self.stall_timeout is None:
            return
        began = time.monotonic()
        while not res.ready():
            idle = time.monotonic() - max(began, last_return[0])
            if idle >= self.stall_timeout:
                raise _Stalled(first, last, ref, idle, returned_any=last_return[1] > 0)
            res.wait(self.stall_timeout - idle)

    def run(self) -> dict:
        os.makedirs(self.out_dir, exist_ok=True)
        header = self.header()
        manifest_path = os.path.join(self.out_dir, S.MANIFEST)
        if self.overwrite:
            for name in os.listdir(self.out_dir):
                if name.startswith("shard-") or name in (S.MANIFEST, S.PROGRESS, S.REJECTS, S.REJECT_PARTS) \
                        or name.endswith(".tmp"):
                    p = os.path.join(self.out_dir, name)
                    shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
        if os.path.exists(manifest_path):
            done = S.read_manifest(self.out_dir)
            if _identity(done) == _identity(header):
                return done  # already built: nothing to do
            raise FileExistsError(f"{self.out_dir} holds a finished build of a different config/input; "
                                  "pass overwrite=True (--overwrite) to replace it")

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

        start = parts[-1]["end_record"] if parts else 0
        part = self._new_part(len(parts))
        next_record = start
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(unit="rec", desc="data_prep build", initial=start, dynamic_ncols=True)
        target = self.cfg.shards.shard_bytes
        results = self._results(start)
        try:
            for n, (batch, rejects) in results:
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
        except _Stalled as e:  # raised out of _results: its pool has been terminated on the way
            part.abort()
            raise TimeoutError(
                f"data_prep build stalled in part {part.index} ({S.shard_name(part.index)}): no worker "
                f"returned a chunk for {e.idle:.0f} s (stall_timeout) while the build waited for records "
                f"{e.first}-{e.last} (from {e.ref}). A worker hung or died (killed for memory?); the "
                f"workers were stopped. The {len(parts)} finished parts are kept: rerun to resume."
                + ("" if e.returned_any else
                   " No chunk came back at all: if the workers could not start, the errors above say why"
                   " (a script that calls data_prep.build with workers needs `if __name__ == \"__main__\":`)")
            ) from None
        except BaseException:
            part.abort()
            results.close()  # a failure here, while _results is suspended, terminates its pool
            raise
        if bar is not None:
            bar.close()
        self._check_rejects(parts)
        return S.finish(self.out_dir, parts, header)

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
                "bytes": os.path.getsize(path), "sha256": S.sha256_file(path),
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
                "bytes": os.path.getsize(path), "sha256": S.sha256_file(path),
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


def _identity(header: dict) -> tuple:
    return (header["config_fingerprint"], header["tokenizer"]["fingerprint"],
            _digest(header["sources"]))


def build(cfg: BuildConfig, out_dir: str, **kwargs) -> dict:
    """Build (or resume, or confirm) the shards of `cfg` in `out_dir`; returns the manifest."""
    return Builder(cfg, out_dir, **kwargs).run()
