"""The encoding side of a build: the worker processes, what each one holds, and the pool that hands
them chunks of records and takes the encoded chunks back in order (build.py writes them).

Decisions:
- Worker processes start with "forkserver" where the platform has it, else "spawn"; never "fork" by
  default. A main process that has used torch's OpenMP thread pool (the numeric vocabulary of a 128k+
  token tokenizer is built with parallel torch ops) or the tokenizer's threads cannot be forked safely:
  the child inherits those pools without their threads, and its first parallel op waits forever (a build
  with a real tokenizer hung in every worker). A forkserver is a fresh interpreter that never ran a
  thread pool: it imports the heavy modules once (`_PRELOAD`) and forks each worker from that clean
  state, so workers start in about the time a fork takes plus loading the tokenizer.
  `start_method="fork"` is still accepted for callers that know their main process is single-threaded.
- Set-up first, and once: a build starts its pool before anything else, and the build's description
  of the tokenizer and numeric vocabulary (`Encoder.describe`, the header the manifest and a resume
  check) comes from the first worker that is ready. The main process never loads the tokenizer, builds
  the numeric vocabulary or imports torch and transformers itself; it hashes the input files while the
  workers load. (Loading it there first, then again in each worker, put ~1 s of CPU for a 128k-token
  tokenizer, and for a command-line build the ~4 s import of torch and transformers, in series before
  the first record was encoded.) With `workers=0` the main process loads it once and encodes itself.
- Set-up errors: a Pool restarts a worker whose initializer raises, forever, so the initializer keeps
  the error and every task raises it. The description is the first task: a tokenizer that cannot be
  loaded fails the build there with the worker's exception (its type, message and traceback: the same
  error as with `workers=0`), before any output file is touched.
- Workers encode single-threaded (TOKENIZERS_PARALLELISM=false, one torch thread) so that `workers`
  processes use `workers` cores. With workers=0 the tokenizer's own threads are used.
- Each worker encodes in a thread of its own, not in its main thread. The Rust tokenizer allocates
  and frees a heap string per token (its `Encoding`s); in a process's main thread those calls go to
  glibc's main arena, where encoding chunk after chunk (each chunk's encodings freed before the next is
  made) cost ~20% more CPU than the same encodings made in any other thread, whose arena is a separate
  mmap'd heap (measured here with a 128k-token tokenizer: 20,000 GSM8K-like records in chunks of 512,
  5.5 s in the main thread against 4.5 s in another, single-threaded either way; keeping every
  encoding until the end made the main thread as fast, so it is the free/alloc cycle in that arena).
- Watchdog: the main process waits for the description and for each chunk with a deadline. When no
  task has come back for `stall_timeout` seconds of waiting (a worker hung, in its set-up or on a
  chunk, or was killed: a pool never returns a lost task), `Stalled` is raised; leaving the pool's
  context stops its workers.
"""

from __future__ import annotations

import collections
import concurrent.futures
import gc
import multiprocessing as mp
import os
import pickle
import time
import traceback
from typing import Any, Iterable, Iterator

import pyarrow as pa

from .sources import BadRecord, SourceConfig, make_source
from .tokenize import Encoder, Item, TokenizeConfig

Chunk = list[tuple[int, int, str, Any]]  # (record, source index, ref, raw)
Encoded = tuple[pa.RecordBatch, list[dict]]  # (kept rows, rejects)

# What the forkserver imports once, before it forks workers: each worker then starts with them loaded
# (importing transformers and torch takes seconds per process otherwise). Importing starts no thread.
# "__main__" is what Python preloads by default: the caller's script, imported once, not per worker.
_PRELOAD = ["__main__", "data_prep.build", "numloss.vocab", "transformers",
            "transformers.models.auto.tokenization_auto"]

DEFAULT_STALL_TIMEOUT = 600.0


class Worker:
    """What one process needs to encode chunks: each source's record parser and an Encoder."""

    def __init__(self, sources: list[SourceConfig], tokenize: TokenizeConfig):
        self.sources = [make_source(s) for s in sources]
        self.encoder = Encoder(tokenize)

    def encode_chunk(self, chunk: Chunk) -> Encoded:
        items, rejects = [], []
        for record, si, ref, raw in chunk:
            src = self.sources[si]
            example_id = f"{src.kind}/{ref}"
            try:
                items.append(Item(record, example_id, src.to_example(raw, ref)))
            except BadRecord as e:
                rejects.append({"record": record, "example_id": example_id, "reason": e.reason,
                                "detail": e.detail})
        batch, too_long = self.encoder.encode(items)
        return batch, sorted(rejects + too_long, key=lambda r: r["record"])


# ---- worker process side -----------------------------------------------------------------------
# "worker": Worker and "thread": the executor it encodes in, or "error": the exception its set-up raised
_STATE: dict[str, Any] = {}


def _init_worker(sources: list[SourceConfig], tokenize: TokenizeConfig,
                 environ: dict[str, str] | None = None) -> None:
    try:
        if environ is not None:  # the main process's environment now, as a fork would have it (a
            os.environ.clear()   # forkserver child has the environment the server started with)
            os.environ.update(environ)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        import torch

        torch.set_num_threads(1)  # the numeric vocabulary's table ops: one core per worker
        _STATE["worker"] = Worker(sources, tokenize)
        _STATE["thread"] = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="data_prep-encode")
    except Exception as e:  # a Pool restarts a worker whose initializer raises, forever: report it instead
        _STATE["error"] = _sendable(e, traceback.format_exc())


def _sendable(e: Exception, tb: str) -> Exception:
    """`e` if it survives pickling (the pool sends it to the main process), else a RuntimeError
    naming it: an exception that fails to unpickle there would stop the pool's result thread."""
    try:
        if type(pickle.loads(pickle.dumps(e))) is type(e):
            return e
    except Exception:
        pass
    return RuntimeError(f"worker set-up failed: {type(e).__name__}: {e}\n{tb}")


def _worker() -> Worker:
    if "error" in _STATE:
        raise _STATE["error"]
    return _STATE["worker"]


def _describe() -> dict:
    return _worker().encoder.describe()


def _encode_chunk(chunk: Chunk) -> Encoded:
    """chunk: (record, source index, ref, raw) -> (rows RecordBatch, rejects)."""
    worker = _worker()
    try:  # in the encoding thread, not this (main) thread: see the module docstring
        return _STATE["thread"].submit(worker.encode_chunk, chunk).result()
    except Exception as e:  # name the records, keep the traceback: pool errors are otherwise opaque
        first = chunk[0][2] if chunk else "?"
        raise RuntimeError(f"encoding records from {first} failed: {e}\n{traceback.format_exc()}") from None


# ---- main process side -------------------------------------------------------------------------
class Stalled(Exception):
    """No task came back for `idle` seconds while the main process waited for records first..last
    (first is None: for a worker's set-up)."""

    def __init__(self, first: int | None, last: int | None, ref: str | None, idle: float,
                 returned_any: bool):
        super().__init__(f"records {first}-{last}" if first is not None else "worker set-up")
        self.first, self.last, self.ref, self.idle = first, last, ref, idle
        self.returned_any = returned_any


class LocalEncoding:
    """workers=0: the main process loads the tokenizer once and encodes every chunk itself."""

    def __init__(self, sources: list[SourceConfig], tokenize: TokenizeConfig):
        self.worker = Worker(sources, tokenize)

    def __enter__(self) -> "LocalEncoding":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def describe(self) -> dict:
        return self.worker.encoder.describe()

    def results(self, chunks: Iterable[Chunk]) -> Iterator[tuple[int, Encoded]]:
        for chunk in chunks:
            yield len(chunk), self.worker.encode_chunk(chunk)


class PoolEncoding:
    """`workers` processes, started (and loading the tokenizer) as soon as this is constructed.

    `describe()` waits for the first worker's description; `results(chunks)` yields the encoded
    chunks in submission order with at most `2 * workers + 2` in flight. Leaving the context
    terminates the workers, whatever state they are in.
    """

    def __init__(self, sources: list[SourceConfig], tokenize: TokenizeConfig, workers: int,
                 start_method: str, stall_timeout: float | None):
        self.workers, self.stall_timeout = workers, stall_timeout
        ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            ctx.set_forkserver_preload(_PRELOAD)  # no effect once this process's forkserver runs
        # (start_method "fork") Forked workers share the parent's pages until they write to them, and
        # the cyclic garbage collector writes to every object it visits: frozen objects are never
        # visited, so a worker's first collections do not copy the parent's heap (about 0.1 s per worker
        # with torch loaded).
        gc.freeze()
        try:
            self.pool = ctx.Pool(workers, initializer=_init_worker,
                                 initargs=(sources, tokenize, dict(os.environ)))
        finally:
            gc.unfreeze()
        # When a task last came back, and how many have (set by the pool's result thread).
        self.last_return = [time.monotonic(), 0]
        self._description = self.pool.apply_async(_describe, callback=self._returned,
                                                  error_callback=self._returned)

    def _returned(self, _) -> None:
        self.last_return[0] = time.monotonic()
        self.last_return[1] += 1

    def __enter__(self) -> "PoolEncoding":
        return self

    def __exit__(self, *exc) -> None:
        self.pool.terminate()

    def describe(self) -> dict:
        """The first worker's `Encoder.describe()`; raises the exception a worker's set-up raised."""
        self._wait(self._description, None, None, None)
        return self._description.get()

    def results(self, chunks: Iterable[Chunk]) -> Iterator[tuple[int, Encoded]]:
        pending: collections.deque = collections.deque()

        def take():
            first, last, ref, n, res = pending.popleft()
            self._wait(res, first, last, ref)
            return n, res.get()

        for chunk in chunks:
            res = self.pool.apply_async(_encode_chunk, (chunk,), callback=self._returned,
                                        error_callback=self._returned)
            pending.append((chunk[0][0], chunk[-1][0], chunk[0][2], len(chunk), res))
            while len(pending) > 2 * self.workers + 2:
                yield take()
        while pending:
            yield take()

    def _wait(self, res, first: int | None, last: int | None, ref: str | None) -> None:
        """Wait for `res` until no task has come back for `stall_timeout` seconds of this wait."""
        if self.stall_timeout is None:
            return
        began = time.monotonic()
        while not res.ready():
            idle = time.monotonic() - max(began, self.last_return[0])
            if idle >= self.stall_timeout:
                raise Stalled(first, last, ref, idle, returned_any=self.last_return[1] > 0)
            res.wait(self.stall_timeout - idle)


def start_encoding(sources: list[SourceConfig], tokenize: TokenizeConfig, workers: int,
                   start_method: str, stall_timeout: float | None) -> LocalEncoding | PoolEncoding:
    """The encoding side of a build, started: in this process (workers <= 0) or in a pool."""
    if workers <= 0:
        return LocalEncoding(sources, tokenize)
    return PoolEncoding(sources, tokenize, workers, start_method, stall_timeout)
