"""Command line: `python -m data_prep build ...`, `python -m data_prep inspect DIR` and `python -m data_prep stats DIR`.

    python -m data_prep build --source gsm8k --path gsm8k/train.jsonl --tokenizer Qwen/Qwen2.5-0.5B \
        --out data/gsm8k-qwen --max-length 1024 --workers 8
    python -m data_prep build --source arithmetic --opt n=100000 --opt module=mixed --tokenizer ./tok --out data/arith
    python -m data_prep build --source gsm8k --hub openai/gsm8k --hub-config main --split train ...
    python -m data_prep build --config build.json --out data/mix     # a BuildConfig as JSON (several sources)
    python -m data_prep inspect data/gsm8k-qwen --row 3
    python -m data_prep stats data/old-build    # per-shard token statistics into a manifest built without them

`--opt KEY=VALUE` sets a source option; VALUE is read as JSON when it parses (numbers, true/false,
lists), else as a string. Rerunning an interrupted build with the same arguments resumes it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .build import DEFAULT_STALL_TIMEOUT, BuildConfig, build
from .shards import ShardConfig, read_manifest
from .sources import SOURCES, SourceConfig
from .tokenize import TokenizeConfig


def _opt(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--opt expects KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _config_from_args(a: argparse.Namespace) -> BuildConfig:
    if a.config:
        with open(a.config) as fh:
            return BuildConfig.from_dict(json.load(fh))
    if not a.source or not a.tokenizer:
        raise SystemExit("build: give --source and --tokenizer (or --config FILE)")
    src = SourceConfig(kind=a.source, path=a.path, hub=a.hub, hub_config=a.hub_config, split=a.split,
                       revision=a.revision, options=dict(a.opt or []), limit=a.limit)
    tok = TokenizeConfig(tokenizer=a.tokenizer, template=a.template, system_prompt=a.system_prompt,
                         plain_separator=a.plain_separator, max_length=a.max_length, numeric_policy=a.numeric_policy,
                         numeric_max_value=a.numeric_max_value, space_variants=a.space_variants,
                         allow_unk=a.allow_unk)
    shards = ShardConfig(shard_bytes=int(a.shard_mb * (1 << 20)), row_group_rows=a.row_group_rows,
                         pack_length=a.pack_length)
    return BuildConfig(sources=[src], tokenize=tok, shards=shards, max_reject_fraction=a.max_reject_fraction)


def cmd_build(a: argparse.Namespace) -> int:
    cfg = _config_from_args(a)
    m = build(cfg, a.out, workers=a.workers, chunk_size=a.chunk_size, progress=not a.no_progress,
              overwrite=a.overwrite, start_method=a.start_method,
              stall_timeout=a.stall_timeout if a.stall_timeout > 0 else None)
    t = m["totals"]
    print(f"{a.out}: {len(m['shards'])} shards, {t['rows']} rows, {t['tokens']} tokens; "
          f"read {t['records_read']} = kept {t['examples_kept']} + rejected {t['rejected']} "
          f"{m['rejects']['by_reason'] or ''}")
    return 0


def summary(m: dict) -> str:
    t, tok, nv = m["totals"], m["tokenizer"], m["numeric_vocab"]
    lines = [
        f"schema v{m['schema_version']}  packed={m['packed']}  config {m['config_fingerprint'][:12]}",
        f"tokenizer {tok['name']}  ({tok['template']} template, {tok['length']} tokens, "
        f"fingerprint {tok['fingerprint'][:12]})",
        f"numeric vocab: policy {nv['policy']}, {nv['size']} tokens",
        f"records read {t['records_read']} = kept {t['examples_kept']} + rejected {t['rejected']}",
        f"rows {t['rows']}  tokens {t['tokens']}  labelled {t['label_tokens']}  numeric {t['numeric_tokens']}",
        "rejects: " + (", ".join(f"{k} {v}" for k, v in m["rejects"]["by_reason"].items()) or "none"),
        "sources:",
    ]
    for s in m["sources"]:
        where = s.get("hub") or ", ".join(f"{k} ({v[:12]})" for k, v in s.get("files", {}).items()) \
            or "generator"
        lines.append(f"  {s['kind']}: {where}")
    lines.append(f"shards ({len(m['shards'])}):")
    for s in m["shards"][:10]:
        lines.append(f"  {s['file']}  rows {s['rows']}  tokens {s['tokens']}  {s['bytes']} B  "
                     f"sha256 {s['sha256'][:12]}")
    if len(m["shards"]) > 10:
        lines.append(f"  ... {len(m['shards']) - 10} more")
    return "\n".join(lines)


def render_row(row: dict, decode) -> str:
    """One row with its masked, labelled and numeric positions marked."""
    ids, labels, numeric = row["input_ids"], row["labels"], row["numeric_mask"]
    parts = []
    for t, lab, num in zip(ids, labels, numeric):
        text = decode(t).replace("\n", "\\n")
        parts.append(f"«{text}»" if num else (f"[{text}]" if lab == -100 else f"⟨{text}⟩"))
    n_masked = sum(1 for x in labels if x == -100)
    head = (f"{len(ids)} tokens: {n_masked} masked, {len(ids) - n_masked} labelled, "
            f"{sum(map(bool, numeric))} numeric")
    spans = "; ".join(f"{v:g} @ {s}:{e} {''.join(decode(i) for i in ids[s:e])!r}"
                      for s, e, v in zip(row["span_start"], row["span_end"], row["span_value"]))
    return "\n".join([head, "legend: [masked] ⟨labelled⟩ «numeric»", "".join(parts),
                      f"number spans: {spans or 'none'}"])


def cmd_inspect(a: argparse.Namespace) -> int:
    import pyarrow.parquet as pq

    m = read_manifest(a.dir)
    print(summary(m))
    if not m["shards"]:
        return 0
    table = pq.read_table(os.path.join(a.dir, m["shards"][0]["file"]))
    row = table.slice(min(a.row, table.num_rows - 1), 1).to_pylist()[0]
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(m["tokenizer"]["name"])
        decode = lambda i: tok.decode([i])  # noqa: E731
    except Exception as e:  # the tokenizer may not be reachable from here: show ids instead
        print(f"(tokenizer not loadable: {e}; showing ids)")
        decode = str
    ident = row.get("example_id") or ", ".join(row.get("example_ids", []))
    answer = row.get("answer", row.get("answers"))
    print(f"\nsample: {m['shards'][0]['file']} row {a.row} ({ident}), answer {answer}")
    print(render_row(row, decode))
    return 0


def cmd_stats(a: argparse.Namespace) -> int:
    from .stats import write_stats

    n = write_stats(a.dir, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(f"{a.dir}: statistics of {n} shard(s) written into its manifest" if n else
          f"{a.dir}: every shard's statistics are in its manifest already")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m data_prep", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("build", help="tokenize a source into shards (resumes an interrupted build)")
    b.add_argument("--config", help="a BuildConfig as JSON (replaces the source/tokenizer flags)")
    b.add_argument("--source", choices=sorted(SOURCES))
    b.add_argument("--path", help="local file, directory or glob")
    b.add_argument("--hub", help="Hugging Face hub dataset name (streamed; needs network)")
    b.add_argument("--hub-config")
    b.add_argument("--split", default="train")
    b.add_argument("--revision")
    b.add_argument("--limit", type=int)
    b.add_argument("--opt", type=_opt, action="append", metavar="KEY=VALUE", help="source option")
    b.add_argument("--tokenizer", help="hub name or local directory")
    b.add_argument("--template", default="auto", choices=["auto", "chat", "plain"])
    b.add_argument("--system-prompt")
    b.add_argument("--plain-separator", default="\n", help="plain template: text between prompt and answer")
    b.add_argument("--allow-unk", action="store_true",
                   help="build although the template's own text becomes the unknown token (refused by default)")
    b.add_argument("--max-length", type=int, default=4096)
    b.add_argument("--numeric-policy", default="digits", choices=["digits", "integers", "float"])
    b.add_argument("--numeric-max-value", type=int, default=999)
    b.add_argument("--space-variants", action="store_true")
    b.add_argument("--shard-mb", type=float, default=256.0, help="target shard size (uncompressed MiB)")
    b.add_argument("--row-group-rows", type=int, default=1024)
    b.add_argument("--pack-length", type=int, help="pack examples into rows of this many tokens")
    b.add_argument("--max-reject-fraction", type=float, default=0.5)
    b.add_argument("--out", required=True)
    b.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    b.add_argument("--chunk-size", type=int, default=256)
    b.add_argument("--start-method", choices=["forkserver", "spawn", "fork"],
                   help="how worker processes start (default forkserver, else spawn; fork is unsafe "
                        "once torch or the tokenizer has run threads in this process)")
    b.add_argument("--stall-timeout", type=float, default=DEFAULT_STALL_TIMEOUT, metavar="SECONDS",
                   help="fail the build when no worker returns a chunk for this long (0: wait forever)")
    b.add_argument("--no-progress", action="store_true")
    b.add_argument("--overwrite", action="store_true")
    b.set_defaults(fn=cmd_build)

    i = sub.add_parser("inspect", help="manifest summary and a decoded sample")
    i.add_argument("dir")
    i.add_argument("--row", type=int, default=0, help="row of the first shard to show")
    i.set_defaults(fn=cmd_inspect)

    st = sub.add_parser("stats", help="per-shard token statistics (longest row, label range, scored labels, "
                                      "row-length agreement) into a manifest built before data_prep recorded them")
    st.add_argument("dir")
    st.set_defaults(fn=cmd_stats)

    a = p.parse_args(argv)
    try:
        return a.fn(a)
    except (ValueError, FileNotFoundError, FileExistsError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
