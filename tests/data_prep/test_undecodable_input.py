"""Input that is not UTF-8 (data_prep/sources/base.py). Before: one invalid byte in a JSONL source aborted the
whole build with "'utf-8' codec can't decode byte 0xff in position 359", naming no file and no line, and
left `_progress.json`. Now a line-based source (JSONL, DeepMind-Math text) rejects that record under the
build's bad-record policy (`invalid_utf8`, naming file, line and byte offset: counted in the rejects, the
build stops only past `max_reject_fraction`); a whole-file format (JSON, CSV) stops naming file, line and
byte offset."""

from __future__ import annotations

import json
import os

import pytest
from tests.data_prep.helpers import GSM8K_ROWS
from tests.data_prep.test_build import config

from data_prep import build
from data_prep.sources import BadRecord, SourceConfig, make_source

BAD = b'{"question": "How many apples\xff?", "answer": "#### 3"}\n'  # 0xff is never UTF-8
COLUMN = BAD.index(0xFF) + 1


def _jsonl(path, good: int, bad_at: list[int]) -> list[bytes]:
    """`good` GSM8K lines with BAD inserted at the given 0-based line positions; returns the lines."""
    lines = [(json.dumps(GSM8K_ROWS[i % len(GSM8K_ROWS)]) + "\n").encode() for i in range(good)]
    for at in sorted(bad_at):
        lines.insert(at, BAD)
    path.write_bytes(b"".join(lines))
    return lines


def _offset(lines: list[bytes], index: int) -> int:
    """The file's byte offset of the 0xff in line `index` (0-based), counted from the bytes written."""
    return sum(len(x) for x in lines[:index]) + lines[index].index(b"\xff")


def test_an_undecodable_jsonl_line_is_one_reject_naming_file_line_and_offset(tmp_path):
    path = tmp_path / "train.jsonl"
    lines = _jsonl(path, 4, [2])
    src = make_source(SourceConfig("gsm8k", path=str(path)))
    got = []
    for ref, raw in src.iter_raw():
        try:
            got.append((ref, src.to_example(raw, ref).answer))
        except BadRecord as err:
            got.append((ref, err))
    assert [ref for ref, _ in got] == [f"train.jsonl:{i}" for i in range(1, 6)]
    bad = got[2][1]
    assert isinstance(bad, BadRecord) and bad.reason == "invalid_utf8"
    assert bad.detail.startswith(f"{path}:3: byte offset {_offset(lines, 2)} in the file (column "
                              f"{COLUMN} of the line) is 0xff")
    clean = tmp_path / "clean.jsonl"
    _jsonl(clean, 4, [])
    clean_source = make_source(SourceConfig("gsm8k", path=str(clean)))
    want = [clean_source.to_example(raw, ref).answer for ref, raw in clean_source.iter_raw()]
    assert [a for _, a in got if not isinstance(a, BadRecord)] == want  # the other records as they were


def test_the_build_skips_and_counts_it_under_the_threshold_and_stops_over_it(tmp_path, digits_tok):
    path = tmp_path / "gsm.jsonl"
    lines = _jsonl(path, 20, [7])
    out = tmp_path / "out"
    m = build(config([SourceConfig("gsm8k", path=str(path))], digits_tok), str(out), workers=0, progress=False)
    assert m["totals"]["records_read"] == 21 and m["totals"]["rejected"] == 1 and m["totals"]["examples_kept"] == 20
    assert m["rejects"]["by_reason"] == {"invalid_utf8": 1}
    (reject,) = [json.loads(line) for line in open(out / "rejects.jsonl")]
    assert reject["record"] == 7 and reject["example_id"] == "gsm8k/gsm.jsonl:8" and reject["reason"] == "invalid_utf8"
    assert f"{path}:8: byte offset {_offset(lines, 7)} in the file" in reject["detail"], reject
    assert "_progress.json" not in os.listdir(out)  # the build finished

    _jsonl(path, 2, [0, 1, 2])  # 3 of 5 records undecodable: past max_reject_fraction 0.5
    with pytest.raises(ValueError, match=r"3 of 5 records rejected .*top reasons invalid_utf8: 3"):
        build(config([SourceConfig("gsm8k", path=str(path))], digits_tok), str(tmp_path / "out2"), workers=0,
              progress=False)


def test_text_pairs_are_rejected_and_whole_file_formats_name_the_byte(tmp_path):
    d = tmp_path / "dm"
    d.mkdir()
    (d / "arithmetic__add.txt").write_bytes(b"What is 2 + 2?\n4\nWhat is 1 + \xfe1?\n2\n")
    src = make_source(SourceConfig("deepmind_math", path=str(d)))
    refs = []
    for ref, raw in src.iter_raw():
        try:
            refs.append((ref, src.to_example(raw, ref).answer))
        except BadRecord as err:
            refs.append((ref, err.reason))
    assert refs == [("arithmetic__add.txt:1", 4.0), ("arithmetic__add.txt:3", "invalid_utf8")]

    csv_file = tmp_path / "c" / "x.csv"
    csv_file.parent.mkdir()
    csv_file.write_bytes(b"question,answer\nWhat is 1?,1\nWhat \xff,2\n")
    with pytest.raises(ValueError, match=rf"{csv_file}:3: byte offset 34 is 0xff"):
        list(make_source(SourceConfig("generic", path=str(csv_file), options={"prompt_field": "question",
                                                                             "target_field": "answer"})).iter_raw())
    json_file = tmp_path / "j" / "x.json"
    json_file.parent.mkdir()
    json_file.write_bytes(b'[{"question": "a",\n "answer": "\xc3("}]')
    with pytest.raises(ValueError, match=rf"{json_file}:2: byte offset 31 is 0xc3"):
        list(make_source(SourceConfig("svamp", path=str(json_file))).iter_raw())
