"""The dataset training reads: shards split across data-parallel ranks, shuffled per epoch, resumable.

Order of an epoch (the same on every rank, computed, never communicated):
1. The Parquet row groups of all shards (the unit of I/O) are permuted with `rng(seed, epoch)`.
2. Their rows, concatenated in that order, are cut into windows of `shuffle_window` positions and each
   window is permuted with `rng(seed, epoch, window)`. The result is a permutation of all N rows with
   locality: a window touches about shuffle_window / row_group_rows row groups.
3. Training (`global_batch_size` G given): one sample order for every layout. Optimizer step s of the
   epoch trains on positions [s*G, (s+1)*G) of that order, whatever the number of data-parallel
   ranks and the micro-batch split (as Megatron's pretraining sampler): micro-batch a of the step
   (a < G / (world * batch)) is positions s*G + a*world*batch + [0, world*batch), rank r taking its
   r-th `batch_size` rows. The last N mod G rows of an epoch are left out (a different set each
   epoch). Every rank reads from the whole window, not from row groups of its own.
   Length bucketing (`length_bucketing=True`, training order only): the step's G rows are the same, but
   before they are dealt out as above they are sorted by length, longest first (ties in the seeded
   order), so each micro-batch holds rows of similar length and is padded little. What a step trains
   on does not change, only which rank and micro-batch computes which of its rows: with every term
   divided by the step's global counts the loss and gradient are the same up to float summation order.
   The sorted order is the same on every layout, so the resume contract below holds as it is. Longest
   first: the allocator meets the step's largest shape first, and a micro-batch that cannot fit fails
   at the first step.
   Otherwise rank r takes a contiguous slice of that order, so each rank reads only its own row groups:
   - drop_last=True: every rank gets L = floor(N / (world * batch)) * batch rows, the same
     number of full batches (ranks must run the same number of steps); fewer than world * batch rows
     are left out, a different set each epoch.
   - drop_last=False (evaluation): the N rows are split as evenly as possible (sizes differ by at most
     one) and the last batch may be short; every row is read exactly once over all ranks.
4. Batches are consecutive `batch_size` rows of the slice.

State: `state_dict()` says where in which epoch, and what must match to resume (seed, shuffle
settings, the shards' checksums, and the layout). Training (G given): the position is the count of
samples consumed in the epoch, and only G must match, so a run may resume onto another number of
data-parallel ranks or another micro-batch x accumulation split of the same global batch, from a step
boundary. Otherwise the position is the batches consumed, and a changed world size or batch size is
refused rather than silently reshuffled. After `load_state_dict` the next batch is exactly the one
an uninterrupted run would have produced. The state lives in this object: use it directly or in
`DataLoader(ds, batch_size=None, num_workers=0)` (the Parquet decoding runs in C++ threads already);
with DataLoader workers the state would live in the workers.

Batches are dicts of tensors. Unpacked shards: input_ids, labels, attention_mask, position_ids,
numeric_mask [B, T] (T = longest row, rounded up to `pad_to_multiple_of`, or `seq_len` when given),
answer [B] (NaN where absent), record [B], and the number spans flat: span_batch, span_start, span_end,
span_value [K]. Packed shards: input_ids, labels, position_ids, segment_ids (0 on padding),
attention_mask (segment_ids > 0), numeric_mask [B, T]; answers and records flat [K] with
segment_batch [K]. Image sources add `images`: a list of PNG/JPEG bytes (not a tensor; the
vision-language processor decodes them).
"""

from __future__ import annotations

import collections
import hashlib
import math
import os
from typing import Any, Iterator

import numpy as np
import pyarrow.parquet as pq
import torch

from .shards import read_manifest, sha256_file
from .stats import TOKEN_COLUMNS
from .tokenize import IGNORE_INDEX

_LIST_COLS = ("input_ids", "labels", "numeric_mask", "span_start", "span_end", "span_value")
_PACKED_LIST_COLS = _LIST_COLS + ("position_ids", "segment_ids", "records", "answers")


class DataError(ValueError):
    """A shard that cannot be trained on, named with its file (and row group and record when known)."""


VERIFY = ("size", "full", "none")


def _record(cols: dict[str, Any], row: int):
    """The input record of row `row` of a decoded row group (a packed row: its first example's)."""
    if "record" in cols:
        return cols["record"][row]
    values, offsets = cols["records"]
    return values[offsets[row]]


def shard_problem(path: str, shard: dict, verify: str) -> str | None:
    """What is wrong with one shard of the manifest of `path` against its record, in `verify` mode ("size":
    it exists with the recorded size, one stat; "full": and the recorded sha256, every byte read; "none":
    it exists); None when nothing."""
    full = os.path.join(path, shard["file"])
    if not os.path.isfile(full):
        return f"{full}: missing (listed in {path}/manifest.json)"
    if verify != "none" and shard.get("bytes") is not None and os.path.getsize(full) != shard["bytes"]:
        return (f"{full}: {os.path.getsize(full)} bytes, the manifest records {shard['bytes']}: truncated or replaced "
                f"since the build; rebuild the data (python -m data_prep build ...)")
    if verify == "full" and shard.get("sha256") and sha256_file(full) != shard["sha256"]:
        return f"{full}: its sha256 differs from the manifest's: the file changed since the build; rebuild the data"
    return None


class ShardDataset(torch.utils.data.IterableDataset):
    """Batches from a data_prep output directory for one data-parallel rank. See the module docstring.

    Faults name their shard (`DataError`): at open every shard listed in the manifest must exist with
    the recorded size (`verify="size"`, the default: one stat per shard), or the recorded sha256
    (`verify="full"`: every byte read once), and be a readable Parquet file; when a row group is read,
    a decoding error names the file and row group, and a token id or label outside the manifest
    tokenizer's vocabulary, a row whose per-token columns differ in length, or a row longer than
    `seq_len` name the file, row group, row and record."""

    def __init__(self, path: str, batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = True, shuffle_window: int = 8192,
                 seq_len: int | None = None, pad_to_multiple_of: int = 1, pad_id: int | None = None,
                 cache_row_groups: int | None = None, global_batch_size: int | None = None,
                 verify: str = "size", length_bucketing: bool = False):
        if verify not in VERIFY:
            raise ValueError(f"verify: {verify!r} is not one of {list(VERIFY)}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, {world_size})")
        if batch_size < 1 or shuffle_window < 1:
            raise ValueError("batch_size and shuffle_window must be >= 1")
        if global_batch_size is not None:
            if global_batch_size < 1 or global_batch_size % (batch_size * world_size):
                raise ValueError(f"global_batch_size {global_batch_size} is not a multiple of batch_size"
                                 f" {batch_size} x world_size {world_size}")
            if not drop_last:
                raise ValueError("global_batch_size (the training order) needs drop_last=True")
        elif length_bucketing:
            raise ValueError("length_bucketing sorts each global batch: it needs global_batch_size (the training order)")
        self.global_batch_size = global_batch_size
        self.length_bucketing = length_bucketing
        self._sorted_step: tuple[tuple[int, int], np.ndarray] | None = None  # ((epoch, step), its rows sorted)
        self.path = path
        self.manifest = read_manifest(path)
        self.packed = bool(self.manifest["packed"])
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.shuffle_window = shuffle_window
        self.seq_len, self.pad_to_multiple_of = seq_len, pad_to_multiple_of
        tok = self.manifest["tokenizer"]
        self.pad_id = pad_id if pad_id is not None else (
            tok["pad_token_id"] if tok["pad_token_id"] is not None else tok["eos_token_id"] or 0)

        # Row groups of all shards, in (shard, row group) order: (file, row group, global start, rows).
        self.units: list[tuple[str, int, int, int]] = []
        start = 0
        self.vocab_size = tok.get("length")  # token ids and labels must lie in [0, vocab_size)
        for shard in self.manifest["shards"]:
            meta = self._open(shard, verify)
            for g in range(meta.num_row_groups):
                n = meta.row_group(g).num_rows
                self.units.append((shard["file"], g, start, n))
                start += n
        self.num_rows = start
        self._unit_starts = np.array([u[2] for u in self.units] + [start], dtype=np.int64)
        self._has_images = not self.packed
        self.fingerprint = hashlib.sha256(
            "".join(s["sha256"] for s in self.manifest["shards"]).encode()).hexdigest()

        lo, hi = self._rank_range()
        self._lo, self._hi = lo, hi
        if cache_row_groups is None:
            rg = max(1, min((u[3] for u in self.units), default=1))
            cache_row_groups = 2 * math.ceil(shuffle_window / rg) + 4
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._cache_size = cache_row_groups
        self._windows: collections.OrderedDict = collections.OrderedDict()
        self.epoch, self.batch = 0, 0

    # ---- order ----------------------------------------------------------------------------------
    def _rank_range(self) -> tuple[int, int]:
        n, w, b = self.num_rows, self.world_size, self.batch_size
        if self.drop_last:
            per = (n // (w * b)) * b
            return self.rank * per, (self.rank + 1) * per
        base, extra = divmod(n, w)
        lo = self.rank * base + min(self.rank, extra)
        return lo, lo + base + (1 if self.rank < extra else 0)

    @property
    def micro_batches_per_step(self) -> int:
        """Training order: the micro-batches each rank reads per global batch."""
        return self.global_batch_size // (self.batch_size * self.world_size)

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        if self.global_batch_size is not None:
            return (self.num_rows // self.global_batch_size) * self.micro_batches_per_step
        n = self._hi - self._lo
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def _epoch_layout(self, epoch: int):
        """(unit order, start position of each unit in the epoch sequence)."""
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.units))
        else:
            order = np.arange(len(self.units))
        sizes = np.array([self.units[u][3] for u in order], dtype=np.int64)
        starts = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(sizes, out=starts[1:])
        return order, starts

    def _window(self, epoch: int, win: int) -> np.ndarray:
        """The epoch positions of window `win`, in the order its slots are read (permuted when shuffling)."""
        key = (epoch, win)
        cached = self._windows.get(key)
        if cached is not None:
            return cached
        w = self.shuffle_window
        positions = np.arange(win * w, min((win + 1) * w, self.num_rows), dtype=np.int64)
        if self.shuffle:
            positions = np.random.default_rng([self.seed, epoch, win]).permutation(positions)
        self._windows[key] = positions
        if len(self._windows) > 4:
            self._windows.popitem(last=False)
        return positions

    def _rows_at(self, epoch: int, slots: np.ndarray) -> np.ndarray:
        """Global row ids at slots `slots` of the epoch's order."""
        order, starts = self._epoch_layout(epoch)
        w = self.shuffle_window
        positions = np.empty_like(slots)
        for win in np.unique(slots // w):
            pick = slots // w == win
            positions[pick] = self._window(epoch, int(win))[slots[pick] - win * w]
        # position in the epoch sequence -> (unit, offset) -> global row id
        k = np.searchsorted(starts, positions, side="right") - 1
        return self._unit_starts[order[k]] + (positions - starts[k])

    def _rows(self, epoch: int, first: int) -> Iterator[int]:
        """Global row ids of this rank's contiguous slice, from position `first` of the slice on."""
        w = self.shuffle_window
        pos = self._lo + first
        while pos < self._hi:
            stop = min((pos // w + 1) * w, self._hi)
            for row in self._rows_at(epoch, np.arange(pos, stop, dtype=np.int64)):
                yield int(row)
            pos = stop

    def _micro_batch_rows(self, epoch: int, k: int) -> np.ndarray:
        """Training order: the rows of this rank's k-th micro-batch of the epoch (see the module docstring)."""
        step, a = divmod(k, self.micro_batches_per_step)
        offset = (a * self.world_size + self.rank) * self.batch_size
        if self.length_bucketing:
            return self._step_rows_by_length(epoch, step)[offset:offset + self.batch_size]
        start = step * self.global_batch_size + offset
        return self._rows_at(epoch, np.arange(start, start + self.batch_size, dtype=np.int64))

    def _step_rows_by_length(self, epoch: int, step: int) -> np.ndarray:
        """Length bucketing: the rows of global batch `step`, longest first, ties in the seeded order.
        Every rank sorts the same G rows the same way (computed, never communicated)."""
        key = (epoch, step)
        if self._sorted_step is None or self._sorted_step[0] != key:
            start = step * self.global_batch_size
            rows = self._rows_at(epoch, np.arange(start, start + self.global_batch_size, dtype=np.int64))
            lengths = np.array([self._row_length(int(r)) for r in rows], dtype=np.int64)
            self._sorted_step = key, rows[np.argsort(-lengths, kind="stable")]
        return self._sorted_step[1]

    def _row_length(self, row: int) -> int:
        """Tokens in global row `row` (from its row group's offsets; no row is copied)."""
        unit = int(np.searchsorted(self._unit_starts, row, side="right") - 1)
        offsets = self._row_group(unit)["input_ids"][1]
        i = row - self.units[unit][2]
        return int(offsets[i + 1] - offsets[i])

    # ---- I/O ------------------------------------------------------------------------------------
    def _open(self, shard: dict, verify: str):
        """A shard's Parquet metadata, after the manifest's size (and with verify="full" its sha256)."""
        full = os.path.join(self.path, shard["file"])
        problem = shard_problem(self.path, shard, verify)
        if problem:
            raise DataError(problem)
        try:
            return pq.ParquetFile(full).metadata
        except Exception as err:  # noqa: BLE001  (pyarrow's errors name no file)
            raise DataError(f"{full}: not a readable Parquet file ({type(err).__name__}: {err})") from err

    def _check_lengths(self, cols: dict[str, Any], file: str, g: int) -> None:
        """Every per-token column of a row as long as its input_ids (and its num_tokens), and no row
        longer than `seq_len`: a row that breaks either would fail as a bare shape error in the model."""
        lengths = {name: np.diff(cols[name][1]) for name in TOKEN_COLUMNS if name in cols}
        if "num_tokens" in cols:
            lengths["num_tokens"] = np.asarray(cols["num_tokens"], dtype=np.int64)
        ids = lengths["input_ids"]
        bad = np.zeros(len(ids), dtype=bool)
        for n in lengths.values():
            bad |= n != ids
        if bad.any():
            row = int(np.argmax(bad))
            raise DataError(f"{os.path.join(self.path, file)}: row group {g}, row {row} (record {_record(cols, row)}): "
                            f"its per-token columns differ in length ("
                            + ", ".join(f"{k} {int(v[row])}" for k, v in lengths.items())
                            + "); the shard was not written by data_prep build, or was changed since")
        if self.seq_len is not None and len(ids) and ids.max() > self.seq_len:
            row = int(np.argmax(ids > self.seq_len))
            raise DataError(f"{os.path.join(self.path, file)}: row group {g}, row {row} (record {_record(cols, row)}) "
                            f"has {int(ids[row])} tokens, more than data.seq_len {self.seq_len}")

    def _check_ids(self, cols: dict[str, Any], file: str, g: int) -> None:
        """Token ids and labels of a row group inside [0, vocab_size) (labels may also be -100)."""
        if not self.vocab_size:
            return
        for name in ("input_ids", "labels"):
            if name not in cols:
                continue
            values, offsets = cols[name]
            bad = (values >= self.vocab_size) | ((values < 0) & (values != IGNORE_INDEX) if name == "labels"
                                                  else (values < 0))
            if not bad.any():
                continue
            first = int(np.argmax(bad))
            row = int(np.searchsorted(offsets, first, side="right") - 1)
            raise DataError(f"{os.path.join(self.path, file)}: row group {g}, row {row} (record {_record(cols, row)}), "
                            f"position "
                            f"{first - int(offsets[row])}: {name[:-1] if name.endswith('s') else name} "
                            f"{int(values[first])} outside the vocabulary [0, {self.vocab_size}) of the manifest's "
                            f"tokenizer")

    def _row_group(self, unit: int) -> dict[str, Any]:
        cached = self._cache.get(unit)
        if cached is not None:
            self._cache.move_to_end(unit)
            return cached
        file, g, start, n = self.units[unit]
        try:
            table = pq.ParquetFile(os.path.join(self.path, file)).read_row_group(g)
        except Exception as err:  # noqa: BLE001  (`ZSTD decompression failed`, naming no file)
            raise DataError(f"{os.path.join(self.path, file)}: row group {g} (rows {start}-{start + n - 1} of the data) "
                            f"unreadable ({type(err).__name__}: {err}); rebuild the data") from err
        cols: dict[str, Any] = {}
        for name in table.column_names:
            col = table.column(name).combine_chunks()
            if name in _PACKED_LIST_COLS or name in _LIST_COLS:
                cols[name] = (col.values.to_numpy(zero_copy_only=False), col.offsets.to_numpy())
            else:
                cols[name] = col.to_pylist()
        self._check_lengths(cols, file, g)
        self._check_ids(cols, file, g)
        self._cache[unit] = cols
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return cols

    def _fetch(self, row: int) -> dict[str, Any]:
        unit = int(np.searchsorted(self._unit_starts, row, side="right") - 1)
        cols = self._row_group(unit)
        i = row - self.units[unit][2]
        out = {}
        for name, col in cols.items():
            if isinstance(col, tuple):
                values, offs = col
                out[name] = values[offs[i]:offs[i + 1]]
            else:
                out[name] = col[i]
        return out

    # ---- batches --------------------------------------------------------------------------------
    def _collate(self, rows: list[dict]) -> dict[str, Any]:
        lengths = [len(r["input_ids"]) for r in rows]
        t = max(lengths)
        if self.seq_len is not None:
            if t > self.seq_len:
                raise ValueError(f"a row of {t} tokens does not fit seq_len {self.seq_len}")
            t = self.seq_len
        m = self.pad_to_multiple_of
        t = -(-t // m) * m
        b = len(rows)
        ids = torch.full((b, t), self.pad_id, dtype=torch.long)
        labels = torch.full((b, t), IGNORE_INDEX, dtype=torch.long)
        numeric = torch.zeros((b, t), dtype=torch.bool)
        position = torch.zeros((b, t), dtype=torch.long)
        segment = torch.zeros((b, t), dtype=torch.long)
        for j, (r, n) in enumerate(zip(rows, lengths)):
            ids[j, :n] = torch.from_numpy(r["input_ids"].astype(np.int64))
            labels[j, :n] = torch.from_numpy(r["labels"].astype(np.int64))
            numeric[j, :n] = torch.from_numpy(r["numeric_mask"].astype(bool))
            if self.packed:
                position[j, :n] = torch.from_numpy(r["position_ids"].astype(np.int64))
                segment[j, :n] = torch.from_numpy(r["segment_ids"].astype(np.int64))
            else:
                position[j, :n] = torch.arange(n)
                segment[j, :n] = 1
        span_batch = np.concatenate([np.full(len(r["span_start"]), j) for j, r in enumerate(rows)])
        out: dict[str, Any] = {
            "input_ids": ids, "labels": labels, "attention_mask": segment > 0,
            "position_ids": position, "numeric_mask": numeric,
            "span_batch": torch.from_numpy(span_batch.astype(np.int64)),
            "span_start": torch.from_numpy(np.concatenate([r["span_start"] for r in rows]).astype(np.int64)),
            "span_end": torch.from_numpy(np.concatenate([r["span_end"] for r in rows]).astype(np.int64)),
            "span_value": torch.from_numpy(np.concatenate([r["span_value"] for r in rows]).astype(np.float64)),
        }
        if self.packed:
            out["segment_ids"] = segment
            out["records"] = torch.from_numpy(np.concatenate([r["records"] for r in rows]).astype(np.int64))
            out["answers"] = torch.tensor([np.nan if a is None else a for r in rows for a in r["answers"]],
                                          dtype=torch.float64)
            out["segment_batch"] = torch.tensor([j for j, r in enumerate(rows) for _ in r["records"]],
                                                dtype=torch.long)
        else:
            out["record"] = torch.tensor([r["record"] for r in rows], dtype=torch.long)
            out["answer"] = torch.tensor([np.nan if r["answer"] is None else r["answer"] for r in rows],
                                         dtype=torch.float64)
            if any(r["image"] is not None for r in rows):
                out["images"] = [r["image"] for r in rows]
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """The rest of the current epoch, from the saved position; then the epoch counter advances."""
        epoch, start = self.epoch, self.batch
        n_batches = len(self)
        if self.global_batch_size is not None:
            for k in range(start, n_batches):
                batch = self._collate([self._fetch(int(r)) for r in self._micro_batch_rows(epoch, k)])
                self.batch = k + 1  # consumed once yielded: a state saved now resumes after this batch
                yield batch
            self.epoch, self.batch = epoch + 1, 0
            return
        rows: list[dict] = []
        k = start
        for row in self._rows(epoch, start * self.batch_size):
            rows.append(self._fetch(row))
            if len(rows) == self.batch_size:
                if k >= n_batches:
                    break
                batch = self._collate(rows)
                rows = []
                k += 1
                self.batch = k  # consumed once yielded: a state saved now resumes after this batch
                yield batch
        if rows and not self.drop_last and k < n_batches:
            k += 1
            self.batch = k
            yield self._collate(rows)
        self.epoch, self.batch = epoch + 1, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.batch = epoch, 0

    # ---- resume ---------------------------------------------------------------------------------
    def _identity(self) -> dict[str, Any]:
        common = {"seed": self.seed, "shuffle": self.shuffle, "shuffle_window": self.shuffle_window,
                  "fingerprint": self.fingerprint}
        if self.global_batch_size is not None:  # the layout may change; the global batch may not
            return {**common, "global_batch_size": self.global_batch_size}
        return {**common, "world_size": self.world_size, "rank": self.rank, "batch_size": self.batch_size,
                "drop_last": self.drop_last}

    def state_dict(self) -> dict[str, Any]:
        if self.global_batch_size is not None:
            return {"epoch": self.epoch, "samples": self.batch * self.batch_size * self.world_size,
                    "length_bucketing": self.length_bucketing, **self._identity()}
        return {"epoch": self.epoch, "batch": self.batch, **self._identity()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self._identity()
        diff = {k: (state.get(k), v) for k, v in mine.items() if state.get(k) != v}
        if diff:
            raise ValueError(f"cannot resume this reader from that state; differences (saved, now): {diff}")
        if self.global_batch_size is None:
            self.epoch, self.batch = int(state["epoch"]), int(state["batch"])
            return
        samples, per_micro_batch = int(state["samples"]), self.batch_size * self.world_size
        # within a step the consumed rows are a prefix of the step's order, which bucketing changes; at a
        # step boundary the order before and after is the same set of steps either way
        if samples % self.global_batch_size and bool(state.get("length_bucketing", False)) != self.length_bucketing:
            raise ValueError(f"cannot resume at sample {samples} of the epoch, inside a global batch of "
                             f"{self.global_batch_size}, with length_bucketing {self.length_bucketing}: the state was "
                             f"saved with {bool(state.get('length_bucketing', False))}; resume from a step boundary")
        if samples % per_micro_batch:  # a step boundary (a multiple of G) always resumes
            raise ValueError(f"cannot resume at sample {samples} of the epoch with micro-batches of {per_micro_batch}"
                             f" samples over all ranks: resume from a step boundary (a multiple of"
                             f" {self.global_batch_size})")
        self.epoch, self.batch = int(state["epoch"]), samples // per_micro_batch
