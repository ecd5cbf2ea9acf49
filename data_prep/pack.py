"""Packing several examples into one sequence, keeping them apart.

Decisions:
- First-fit over a bounded set of open rows (`max_open`, default 64) in arrival order; when an
  example fits no open row and the set is full, the oldest row is closed. Deterministic (depends
  only on the lengths, in order) and streaming; within a shard only, so a shard stays a unit of
  resume.
- A packed row stores `segment_ids` (1, 2, ... per example; the reader pads with 0) and
  `position_ids` restarting at 0 for every example: attention must be block-diagonal by segment
  (flash-attn varlen / position-id based masking), never causal across examples.
- The first token of every segment gets label -100. With the usual one-token shift, the last token
  of example A would otherwise be trained to predict the first token of example B; in an unpacked row
  labels[0] is never a target either, so packed and unpacked rows train the same tokens.
- Spans move with their example (offset by its start in the row); per-example fields become lists
  (records, example_ids, answers, answer_texts, segment_lengths).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from .tokenize import IGNORE_INDEX

PACKED_SCHEMA = pa.schema([
    ("input_ids", pa.list_(pa.int32())),
    ("labels", pa.list_(pa.int32())),
    ("position_ids", pa.list_(pa.int32())),
    ("segment_ids", pa.list_(pa.int32())),
    ("numeric_mask", pa.list_(pa.bool_())),
    ("span_start", pa.list_(pa.int32())),
    ("span_end", pa.list_(pa.int32())),
    ("span_value", pa.list_(pa.float64())),
    ("records", pa.list_(pa.int64())),
    ("example_ids", pa.list_(pa.string())),
    ("answers", pa.list_(pa.float64())),
    ("answer_texts", pa.list_(pa.string())),
    ("segment_lengths", pa.list_(pa.int32())),
    ("num_tokens", pa.int32()),
])


def assign_bins(lengths: list[int], pack_length: int, max_open: int = 64) -> list[list[int]]:
    """Example indices per packed row, in the order rows are closed."""
    done: list[list[int]] = []
    open_rows: list[list] = []  # [used, members]
    for i, n in enumerate(lengths):
        if n > pack_length:
            raise ValueError(f"example of {n} tokens does not fit pack_length {pack_length}")
        for row in open_rows:
            if row[0] + n <= pack_length:
                row[0] += n
                row[1].append(i)
                break
        else:
            if len(open_rows) == max_open:
                done.append(open_rows.pop(0)[1])
            open_rows.append([n, [i]])
    done.extend(row[1] for row in open_rows)
    return done


def _flat(col: pa.ChunkedArray | pa.Array):
    """(values ndarray, offsets ndarray) of a list column."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    offs = arr.offsets.to_numpy()
    values = arr.values.to_numpy(zero_copy_only=False)
    return values, offs


def pack_table(table: pa.Table, pack_length: int, max_open: int = 64) -> pa.Table:
    """Unpacked rows (tokenize.ROW_SCHEMA) -> packed rows (PACKED_SCHEMA)."""
    lengths = table.column("num_tokens").to_numpy()
    rows = assign_bins(lengths.tolist(), pack_length, max_open)
    ids, offs = _flat(table.column("input_ids"))
    labels, _ = _flat(table.column("labels"))
    numeric, _ = _flat(table.column("numeric_mask"))
    s_start, s_offs = _flat(table.column("span_start"))
    s_end, _ = _flat(table.column("span_end"))
    s_val, _ = _flat(table.column("span_value"))
    records = table.column("record").to_pylist()
    example_ids = table.column("example_id").to_pylist()
    answers = table.column("answer").to_pylist()
    answer_texts = table.column("answer_text").to_pylist()

    out = {name: [] for name in PACKED_SCHEMA.names}
    for members in rows:
        seg_labels = []
        starts, ends, vals = [], [], []
        pos = 0
        for i in members:
            a, b = offs[i], offs[i + 1]
            lab = labels[a:b].copy()
            lab[0] = IGNORE_INDEX  # see the module docstring
            seg_labels.append(lab)
            sa, sb = s_offs[i], s_offs[i + 1]
            starts.append(s_start[sa:sb] + pos)
            ends.append(s_end[sa:sb] + pos)
            vals.append(s_val[sa:sb])
            pos += b - a
        lab = np.concatenate(seg_labels)
        num = np.concatenate([numeric[offs[i]:offs[i + 1]] for i in members]) & (lab != IGNORE_INDEX)
        out["input_ids"].append(np.concatenate([ids[offs[i]:offs[i + 1]] for i in members]))
        out["labels"].append(lab)
        out["position_ids"].append(np.concatenate([np.arange(lengths[i], dtype=np.int32) for i in members]))
        out["segment_ids"].append(np.concatenate(
            [np.full(lengths[i], k + 1, dtype=np.int32) for k, i in enumerate(members)]))
        out["numeric_mask"].append(num)
        out["span_start"].append(np.concatenate(starts))
        out["span_end"].append(np.concatenate(ends))
        out["span_value"].append(np.concatenate(vals))
        out["records"].append([records[i] for i in members])
        out["example_ids"].append([example_ids[i] for i in members])
        out["answers"].append([answers[i] for i in members])
        out["answer_texts"].append([answer_texts[i] for i in members])
        out["segment_lengths"].append([int(lengths[i]) for i in members])
        out["num_tokens"].append(int(pos))
    return pa.Table.from_pydict(out, schema=PACKED_SCHEMA)
