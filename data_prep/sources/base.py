"""What every source adapter turns its records into, and the helpers adapters share.

A source is split in two halves on purpose:

- `iter_raw()` runs in the main process and only *reads*: it yields `(ref, raw)` pairs in a fixed
  order, where `ref` names the record for errors and rejects ("train.jsonl:12") and `raw` is whatever
  is cheap to produce and pickle (a JSONL line, a CSV row, generator parameters). It must stream:
  a corpus larger than RAM is never held in memory.
- `to_example(raw, ref)` runs in a worker process and does the real work (JSON parsing, answer
  parsing, image decoding or rendering). It returns an `Example`, or raises `BadRecord(reason)`;
  the builder turns that into a line of the rejects file. Nothing is dropped silently.

Decisions:
- A record's identity is `ref`, built from the path *relative to the source root* plus a line or row
  number, so the same files give the same ids wherever they are checked out.
- Answers are read by `data_prep.answers.parse_answer`, the reader the evaluation reads model outputs
  with (thousands separators, currency and units, fractions, signs; a text that is not one number, such
  as a surd, is no answer), so gold and prediction are read alike.
- `require_answer` (default True): a record with no parsable numeric answer is rejected
  ("no_answer"). Sources with non-numeric answers (ChartQA) can switch it off per build.
"""

from __future__ import annotations

import glob
import io
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator

from ..shards import sha256_file

# Reasons a record can be rejected; the rejects summary counts by these names.
NO_ANSWER = "no_answer"
EMPTY_TARGET = "empty_target"
EMPTY_PROMPT = "empty_prompt"
TOO_LONG = "too_long"
BROKEN_IMAGE = "broken_image"
INVALID_JSON = "invalid_json"
INVALID_UTF8 = "invalid_utf8"
MISSING_FIELD = "missing_field"
BAD_VALUE = "bad_value"


class BadRecord(Exception):
    """A record that cannot be used. `reason` is one of the names above; `detail` says why."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass
class Example:
    """One training example, whatever the source: prompt, target text, final number, optional image."""

    prompt: str
    target: str
    answer: float | None
    answer_text: str | None = None
    image: bytes | None = None  # encoded image (PNG/JPEG bytes), carried as is
    # False: the numbers of the target text are not decimal numbers (a numeral in base 16): no spans.
    number_spans: bool = True


@dataclass
class SourceConfig:
    """Where a source reads from and how.

    kind: the adapter ("gsm8k", "svamp", "deepmind_math", "arithmetic", "clock", "clock_text",
        "chartqa", "generic").
    path: local file, directory or glob (JSONL, JSON, Parquet, CSV; .txt for DeepMind-Math).
    hub: a Hugging Face hub dataset name, read with `datasets` in streaming mode (needs network).
    hub_config, split, revision: passed to `datasets.load_dataset`.
    options: adapter-specific knobs (field names, generator sizes, require_answer, ...).
    limit: read at most this many records (None: all).
    """

    kind: str
    path: str | None = None
    hub: str | None = None
    hub_config: str | None = None
    split: str = "train"
    revision: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    limit: int | None = None


class Source:
    """Base class of the adapters; see the module docstring for the contract."""

    kind: ClassVar[str] = ""
    # Options an adapter accepts, with their defaults; unknown options are an error (typos fail fast).
    defaults: ClassVar[dict[str, Any]] = {}
    has_images: ClassVar[bool] = False

    def __init__(self, cfg: SourceConfig):
        unknown = set(cfg.options) - set(self.defaults) - {"require_answer"}
        if unknown:
            raise ValueError(
                f"source {self.kind!r}: unknown option(s) {sorted(unknown)}; "
                f"known: {sorted(set(self.defaults) | {'require_answer'})}"
            )
        self.cfg = cfg
        self.opts = {"require_answer": True, **self.defaults, **cfg.options}

    # -- main process ----------------------------------------------------------------------------
    def iter_raw(self) -> Iterator[tuple[str, Any]]:
        """(ref, raw) for every record, in a fixed order, streaming. Applies `cfg.limit`."""
        it = self._iter_raw()
        if self.cfg.limit is None:
            yield from it
            return
        for i, item in enumerate(it):
            if i >= self.cfg.limit:
                return
            yield item

    def check_input(self) -> None:
        """Raise FileNotFoundError when the source's local input is missing (a listing, no hashing): before
        a build starts its workers and fetches the tokenizer."""
        if self.cfg.path and not self.cfg.hub:
            resolve_files(self.cfg.path)

    def _iter_raw(self) -> Iterator[tuple[str, Any]]:
        if self.cfg.hub:
            yield from iter_hub(self.cfg)
        elif self.cfg.path:
            yield from iter_files(self.cfg.path)
        else:
            raise ValueError(f"source {self.kind!r} needs a path or a hub name")

    def fingerprint(self) -> dict[str, Any]:
        """What identifies this source's input: file hashes, or the hub name and revision."""
        base = {"kind": self.kind, "options": self.opts, "limit": self.cfg.limit}
        if self.cfg.hub:
            base.update(hub=self.cfg.hub, hub_config=self.cfg.hub_config, split=self.cfg.split,
                        revision=self.cfg.revision)
        elif self.cfg.path:
            root, files = resolve_files(self.cfg.path)
            base["files"] = {os.path.relpath(f, root): sha256_file(f) for f in files}
        return base

    # -- worker process --------------------------------------------------------------------------
    def to_example(self, raw: Any, ref: str) -> Example:
        row = decode_row(raw)
        return self.finish(self.row_to_example(row, raw_base_dir(raw)))

    def row_to_example(self, row: dict, base_dir: str | None) -> Example:
        raise NotImplementedError

    def finish(self, ex: Example) -> Example:
        """Checks common to every source."""
        if not ex.target or not ex.target.strip():
            raise BadRecord(EMPTY_TARGET, "the target text is empty")
        if self.opts["require_answer"] and ex.answer is None:
            raise BadRecord(NO_ANSWER, f"no numeric answer in {short(ex.answer_text or ex.target)!r}")
        if ex.image is not None:
            check_image(ex.image)
        return ex


# ---- reading files ------------------------------------------------------------------------------
TABLE_EXTS = (".jsonl", ".json", ".parquet", ".csv", ".txt")


def resolve_files(path: str, exts: tuple[str, ...] = TABLE_EXTS) -> tuple[str, list[str]]:
    """(root, sorted files) for a file, a directory (its data files, recursively) or a glob."""
    if os.path.isdir(path):
        files = [
            os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(exts)
        ]
        root = path
    elif any(c in path for c in "*?["):
        files = [f for f in glob.glob(path, recursive=True) if os.path.isfile(f)]
        root = os.path.dirname(path.split("*")[0].split("?")[0].split("[")[0]) or "."
    elif os.path.isfile(path):
        files = [path]
        root = os.path.dirname(path) or "."
    else:
        raise FileNotFoundError(f"no such file or directory: {path}")
    if not files:
        raise FileNotFoundError(f"{path}: no data files ({', '.join(exts)}) found")
    return root, sorted(files)


class RawRow:
    """A record as read from a file, still undecoded (JSON parsing happens in the workers)."""

    __slots__ = ("data", "base_dir")

    def __init__(self, data: Any, base_dir: str | None):
        self.data = data
        self.base_dir = base_dir


def iter_files(path: str) -> Iterator[tuple[str, RawRow]]:
    """Stream the records of every file under `path`; refs are "relative/path:line" (1-based)."""
    root, files = resolve_files(path)
    for f in files:
        rel = os.path.relpath(f, root)
        base = os.path.dirname(os.path.abspath(f))
        if f.endswith(".jsonl"):
            for lineno, line in _text_lines(f):
                if isinstance(line, Undecodable) or line.strip():
                    yield f"{rel}:{lineno}", RawRow(line, base)
        elif f.endswith(".json"):
            # A JSON array (SVAMP ships one): small by nature, read whole.
            with open(f, "rb") as fh:
                raw = fh.read()
            try:
                data = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise _undecodable_file(f, e, raw) from None
            except json.JSONDecodeError as e:
                raise ValueError(f"{f}: not valid JSON (line {e.lineno}): {e.msg}") from None
            if isinstance(data, dict):
                data = [data]
            if not isinstance(data, list):
                raise ValueError(f"{f}: expected a JSON array of records, got {type(data).__name__}")
            for i, row in enumerate(data):
                yield f"{rel}#{i}", RawRow(row, base)
        elif f.endswith(".csv"):
            import csv

            with open(f, "rb") as fh:
                reader = csv.DictReader(_csv_lines(f, fh))
                try:
                    first = 2  # a record's ref is the line it starts on (quoted fields may span lines)
                    for row in reader:
                        yield f"{rel}:{first}", RawRow(row, base)
                        first = reader.line_num + 1
                except csv.Error as e:
                    raise ValueError(f"{f}:{reader.line_num}: bad CSV: {e}") from None
        elif f.endswith(".parquet"):
            import pyarrow.parquet as pq

            i = 0
            for batch in pq.ParquetFile(f).iter_batches(batch_size=256):
                for row in batch.to_pylist():
                    yield f"{rel}#{i}", RawRow(row, base)
                    i += 1
        elif f.endswith(".txt"):
            yield from iter_question_answer_lines(f, rel)
        else:
            raise ValueError(f"{f}: unsupported file type (expected one of {TABLE_EXTS})")


def _csv_lines(f: str, fh) -> Iterator[str]:
    """A CSV file's lines as text; a line that is not UTF-8 stops the read naming file, line and byte
    offset (a quoted field may span lines, so one record cannot be skipped safely)."""
    offset = 0
    for lineno, raw in enumerate(fh, 1):
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"{f}:{lineno}: byte offset {offset + err.start} is 0x{raw[err.start]:02x}: {err.reason}, "
                             f"not UTF-8; re-encode the file as UTF-8") from None
        offset += len(raw)


def iter_question_answer_lines(f: str, rel: str) -> Iterator[tuple[str, RawRow]]:
    """DeepMind-Math text files: a question line followed by its answer line (a pair with a line that is
    not UTF-8 is one record that is rejected)."""
    question, qline = None, 0
    for lineno, line in _text_lines(f):
        if not isinstance(line, Undecodable):
            line = line.removesuffix("\n").removesuffix("\r")
        if question is None:
            question, qline = line, lineno
        else:
            bad = next((x for x in (question, line) if isinstance(x, Undecodable)), None)
            yield f"{rel}:{qline}", RawRow(bad or {"question": question, "answer": line}, None)
            question = None
    if question is not None:
        raise ValueError(f"{f}:{qline}: question without an answer line (odd number of lines)")


class Undecodable:
    """A line of a text source that is not valid UTF-8, in place of its text: where it is and what is
    wrong, for the reject (`decode_row` raises it as an `invalid_utf8` BadRecord)."""

    __slots__ = ("detail",)

    def __init__(self, detail: str):
        self.detail = detail


def _text_lines(f: str) -> Iterator[tuple[int, "str | Undecodable"]]:
    """(line number, text) of each line of a UTF-8 text file, read as bytes so that one undecodable line
    costs that line (an `Undecodable` naming file, line and byte offset), not the whole file."""
    offset = 0
    with open(f, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as err:
                byte = raw[err.start]
                yield lineno, Undecodable(f"{f}:{lineno}: byte offset {offset + err.start} in the file (column "
                                          f"{err.start + 1} of the line) is 0x{byte:02x}: {err.reason}, not UTF-8")
            offset += len(raw)


def _undecodable_file(f: str, err: UnicodeDecodeError, data: bytes) -> ValueError:
    """The error for a whole-file format (JSON, CSV) that is not UTF-8: file, line and byte offset."""
    line = data.count(b"\n", 0, err.start) + 1
    return ValueError(f"{f}:{line}: byte offset {err.start} is 0x{data[err.start]:02x}: {err.reason}, not UTF-8; "
                      f"re-encode the file as UTF-8")


def iter_hub(cfg: SourceConfig) -> Iterator[tuple[str, RawRow]]:
    """Stream a Hugging Face hub dataset (network needed; nothing is downloaded whole)."""
    import datasets

    ds = datasets.load_dataset(
        cfg.hub, cfg.hub_config, split=cfg.split, revision=cfg.revision, streaming=True
    )
    for i, row in enumerate(ds):
        yield f"{cfg.hub}/{cfg.split}#{i}", RawRow(row, None)


def decode_row(raw: Any) -> dict:
    """The record as a dict; a JSONL line is parsed here (in the worker)."""
    data = raw.data if isinstance(raw, RawRow) else raw
    if isinstance(data, Undecodable):
        raise BadRecord(INVALID_UTF8, data.detail)
    if isinstance(data, str):
        try:
            data = json.loads(data)
        except json.JSONDecodeError as e:
            raise BadRecord(INVALID_JSON, f"{e.msg} at column {e.colno}") from None
    if not isinstance(data, dict):
        raise BadRecord(INVALID_JSON, f"expected an object, got {type(data).__name__}")
    return data


def raw_base_dir(raw: Any) -> str | None:
    return raw.base_dir if isinstance(raw, RawRow) else None


def get_field(row: dict, name: str, kind: str = "str") -> Any:
    """row[name], or a `missing_field` reject naming the field and the fields the record has."""
    if name not in row or row[name] is None:
        raise BadRecord(MISSING_FIELD, f"no field {name!r} (fields: {sorted(row)[:12]})")
    value = row[name]
    if kind == "str":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = format_number(value)
        if not isinstance(value, str):
            raise BadRecord(BAD_VALUE, f"field {name!r} is a {type(value).__name__}, expected text")
    return value


# ---- numbers -----------------------------------------------------------------------------------
def format_number(x: float | int) -> str:
    """Shortest text for a number: 27.0 -> "27", 0.5 -> "0.5"."""
    if isinstance(x, int):
        return str(x)
    if x == int(x) and abs(x) < 1e16:
        return str(int(x))
    return repr(float(x))


# ---- images ------------------------------------------------------------------------------------
def load_image(value: Any, base_dir: str | None) -> bytes:
    """Image bytes from what a record holds: bytes, {"bytes": ...} (HF Image feature) or a path."""
    if isinstance(value, dict):
        if value.get("bytes"):
            return bytes(value["bytes"])
        value = value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if hasattr(value, "save"):  # a PIL image (datasets decodes images by default)
        buf = io.BytesIO()
        value.save(buf, format="PNG")
        return buf.getvalue()
    if isinstance(value, str) and value:
        path = value if os.path.isabs(value) or base_dir is None else os.path.join(base_dir, value)
        try:
            with open(path, "rb") as fh:
                return fh.read()
        except OSError as e:
            raise BadRecord(BROKEN_IMAGE, f"cannot read image {value!r}: {e.strerror}") from None
    raise BadRecord(BROKEN_IMAGE, f"no image data ({type(value).__name__})")


def check_image(data: bytes) -> None:
    """Decode the image fully: a truncated or corrupt file is a `broken_image` reject."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
    except Exception as e:  # PIL raises many types (OSError, SyntaxError, ValueError, ...)
        # Drop object addresses ("<_io.BytesIO object at 0x7f...>") so rejects stay byte-identical.
        message = re.sub(r" at 0x[0-9a-fA-F]+", "", str(e))
        raise BadRecord(BROKEN_IMAGE, f"{type(e).__name__}: {message}") from None


# ---- misc --------------------------------------------------------------------------------------
def short(text: str, n: int = 60) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."
