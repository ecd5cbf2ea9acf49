"""Reports across runs: a Markdown results table, training curves, and the digit-distribution probe.

    python -m recipes.evaluation.report table runs/*/eval_results.json > table.md
    python -m recipes.evaluation.report curves ce=runs/ce/metrics.jsonl smmd=runs/smmd/metrics.jsonl --out curves.png
    python -m recipes.evaluation.report probe ce=runs/ce/final smmd=runs/smmd/final --data DATA --out probe.png

- table: one row per run: the results JSON written by `recipes.evaluation.evaluate` (numloss's own metrics)
  and by `recipes.evaluation.harness` (lm-evaluation-harness tasks) of the same run name share its row when
  their metrics do not overlap. One column per metric any of them reports (n, parse rate, exact match, MAE,
  R², time gap, relaxed accuracy, then e.g. "gsm8k exact_match (strict-match)"), each numloss metric followed
  by the number of rows it used when the results say it; "–" where a run has none; with `interval=True`
  exact match carries its 95% Wilson interval. Under the table, one line per harness task: lm-eval's version,
  backend, the task's version, shots, documents and config hash.
- intervals: `recipes.evaluation.stats`.
- curves: `metrics.jsonl` (one JSON object per optimizer step, as recipes/train.py writes it:
  "step", "loss", "ce", "term/<name>", "lr", ...); one panel per quantity (loss, ce, then each term),
  one line per run, and when the runs logged gradient diagnostics (`numloss.diagnostics`) one panel of
  every part's gradient share `grad/<part>/share` (a line per run and part). Quantities a run does not
  log are simply absent from its panels.
- probe: `recipes.evaluation.probe` (the digit-distribution heatmaps).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from .probe import plot_probe, probe_model
from .stats import wilson_interval

# Column order and headers of the table; metrics not listed here are appended in sorted order.
# Each metric is followed by the number of rows it used, where the results say (evaluate.score).
TABLE_COLUMNS = [
    ("n", "n"),
    ("parse_rate", "parse rate"),
    ("n_numeric", "n parse"),
    ("exact_match", "exact match"),
    ("n_exact_match", "n exact"),
    ("mae", "MAE"),
    ("r2", "R²"),
    ("n_mae_r2", "n MAE/R²"),
    ("time_gap", "time gap (min)"),
    ("n_time_gap", "n gap"),
    ("relaxed_accuracy", "relaxed acc."),
]
_SKIP = {"n_text", "exact_match_95ci"}  # in n_exact_match; in exact match's cell with --interval


# ---- table --------------------------------------------------------------------------------------------


def _fmt(value: Any) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"
    return str(value)


def load_results(paths: Sequence[str]) -> list[dict]:
    out = []
    for p in paths:
        with open(p) as fh:
            res = json.load(fh)
        res.setdefault("name", Path(p).stem)
        out.append(res)
    return out


def merge_runs(results: Sequence[dict]) -> list[dict]:
    """Results of the same run name merged into one (metrics joined, harness records kept in "harness_runs"),
    in first-seen order; results whose metrics overlap stay separate rows."""
    merged: list[dict] = []
    for r in results:
        into = next((m for m in merged if m.get("name") == r.get("name")
                     and not set(m.get("metrics", {})) & set(r.get("metrics", {}))), None)
        if into is None:
            into = {**r, "metrics": dict(r.get("metrics", {})), "harness_runs": []}
            merged.append(into)
        else:
            into["metrics"].update(r.get("metrics", {}))
        if r.get("harness"):
            into["harness_runs"].append(r["harness"])
    return merged


def harness_notes(results: Sequence[dict]) -> list[str]:
    """One line per run and lm-eval task: what produced its numbers."""
    lines = []
    for r in merge_runs(results):
        for h in r.get("harness_runs", []):
            for task, t in h.get("tasks", {}).items():
                n = (t.get("n_samples") or {}).get("effective")
                lines.append(f"- {r.get('name', '?')}: lm-eval {h.get('lm_eval_version')} ({h.get('backend')} backend), "
                             f"{task} version {t.get('version')}, {t.get('n_shot')}-shot, {n} documents, "
                             f"config sha256 {str(t.get('config_sha256'))[:12]}")
    return lines


def markdown_table(results: Sequence[dict], interval: bool = False) -> str:
    """One row per run (its `name`; results of one run merged, `merge_runs`), one column per metric present in
    any run, then one line per lm-eval task (`harness_notes`). `interval`: exact match as "value [low, high]"
    with its 95% Wilson interval over the rows exact match used."""
    notes = harness_notes(results)
    results = merge_runs(results)
    present = set()
    for r in results:
        present.update(k for k in r.get("metrics", {}) if k not in _SKIP)
    cols = [(k, h) for k, h in TABLE_COLUMNS if k in present]
    cols += [(k, k) for k in sorted(present - {k for k, _ in TABLE_COLUMNS})]
    if interval:
        cols = [(k, h + " [95% CI]" if k == "exact_match" else h) for k, h in cols]
    lines = ["| run | " + " | ".join(h for _, h in cols) + " |",
             "|---|" + "|".join("---:" for _ in cols) + "|"]
    for r in results:
        m = r.get("metrics", {})
        name = str(r.get("name", "?")).replace("|", "\\|")
        cells = []
        for k, _ in cols:
            cell = _fmt(m.get(k))
            scored = m.get("n_exact_match", m.get("n_numeric"))  # older results: numeric rows only
            if interval and k == "exact_match" and m.get(k) is not None and scored:
                # the results' own interval; results written before they carried one: from the share and count
                low, high = m.get("exact_match_95ci") or wilson_interval(round(m[k] * scored), scored)
                cell += f" [{low:.3f}, {high:.3f}]"
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


# ---- curves -------------------------------------------------------------------------------------------


def read_metrics_jsonl(path: str) -> list[dict]:
    rows = []
    with open(path) as fh:
        for n, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                # A run killed mid-write leaves a partial last line: skip it, fail on any other.
                if fh.readline():
                    raise ValueError(f"{path}:{n}: not a JSON line") from None
    return rows


def _named(specs: Sequence[str]) -> list[tuple[str, str]]:
    """"name=path" or "path" (named after the path's directory) -> [(name, path)]."""
    out = []
    for s in specs:
        if "=" in s and not os.path.exists(s):
            name, path = s.split("=", 1)
        else:
            path = s
            p = Path(s)
            name = (p.parent.name if p.is_file() or p.suffix or p.name == "final" else p.name) or s
        out.append((name, path))
    return out


SHARES = "grad/*/share"  # the panel of every part's gradient share (numloss.diagnostics)


def _share_parts(runs: dict[str, list[dict]]) -> list[str]:
    """The parts whose `grad/<part>/share` any run logs: ce first, then by name."""
    parts = {k[len("grad/"):-len("/share")] for rows in runs.values() for r in rows for k in r
             if k.startswith("grad/") and k.endswith("/share")}
    return sorted(parts, key=lambda part: (part != "ce", part))


def curve_keys(runs: dict[str, list[dict]]) -> list[str]:
    """Quantities to draw: loss, ce, then every term/<name> any run logs, then the gradient shares'
    panel (`SHARES`) when any run logs them."""
    keys = ["loss", "ce"]
    terms = sorted({k for rows in runs.values() for r in rows for k in r if k.startswith("term/")})
    present = {k for rows in runs.values() for r in rows for k in r}
    return [k for k in keys if k in present] + terms + ([SHARES] if _share_parts(runs) else [])


def _points(rows: list[dict], key: str) -> tuple[tuple, tuple]:
    """(steps, values) of `key` in the rows that log it (a diagnostics key: only the diagnosed steps)."""
    pts = [(r["step"], r[key]) for r in rows if key in r and r[key] is not None and "step" in r]
    return tuple(zip(*pts)) if pts else ((), ())


def _plot_shares(ax, runs: dict[str, list[dict]]) -> None:
    """One line per run and part: one run, a colour per part; several, a colour per run and a line style
    per part."""
    styles = ["-", "--", ":", "-."]
    for p, part in enumerate(_share_parts(runs)):
        for i, (name, rows) in enumerate(runs.items()):
            xs, ys = _points(rows, f"grad/{part}/share")
            if xs:
                single = len(runs) == 1
                ax.plot(xs, ys, label=part if single else f"{name}: {part}", linewidth=1.2,
                        color=f"C{(p if single else i) % 10}", linestyle="-" if single else styles[p % len(styles)])
    ax.set_ylim(0, 1)


def plot_curves(runs: dict[str, list[dict]], out: str, keys: Sequence[str] | None = None) -> str:
    """One panel per quantity, one line per run, against "step". Returns `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(keys or curve_keys(runs))
    if not keys:
        raise ValueError("no loss, ce or term/<name> values in any metrics file")
    ncol = min(3, len(keys))
    nrow = math.ceil(len(keys) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.2 * nrow), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        if key == SHARES:
            _plot_shares(ax, runs)
        for i, (name, rows) in enumerate(runs.items() if key != SHARES else ()):
            xs, ys = _points(rows, key)
            if xs:  # a run keeps its colour in every panel, also in those where the others have no line
                ax.plot(xs, ys, label=name, linewidth=1.2, color=f"C{i % 10}")
        ax.set_title("gradient share on the numbers" if key == SHARES else key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a panel no run logs (e.g. shares before diagnostics) stays empty
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not logged by these runs", ha="center", va="center", transform=ax.transAxes)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# ---- command line -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m recipes.evaluation.report",
                                description=" ".join(__doc__.split("\n\n")[0].split()))  # the first paragraph, whole
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("table", help="Markdown table of results JSON files (one row per run)")
    t.add_argument("results", nargs="+")
    t.add_argument("--out", default=None, help="write here instead of stdout")
    t.add_argument("--interval", action="store_true",
                   help="exact match with its 95%% Wilson interval, [low, high], over the rows it was scored on")
    c = sub.add_parser("curves", help="training curves from metrics.jsonl files")
    c.add_argument("runs", nargs="+", help="[NAME=]metrics.jsonl")
    c.add_argument("--out", required=True)
    c.add_argument("--keys", nargs="*", default=None,
                   help=f"quantities to draw (default: loss, ce, term/*, and {SHARES!r}: the gradient shares' panel)")
    q = sub.add_parser("probe", help="digit-distribution heatmaps, one panel per model")
    q.add_argument("models", nargs="+", help="[NAME=]model_dir")
    q.add_argument("--data", required=True)
    q.add_argument("--out", required=True)
    q.add_argument("--limit", type=int, default=256)
    q.add_argument("--bins", type=int, default=20)
    q.add_argument("--json", default=None, help="also write the probe matrices here")
    a = p.parse_args(argv)
    if a.cmd == "table":
        text = markdown_table(load_results(a.results), interval=a.interval)
        if a.out:
            Path(a.out).write_text(text)
        else:
            sys.stdout.write(text)
    elif a.cmd == "curves":
        runs = {name: read_metrics_jsonl(path) for name, path in _named(a.runs)}
        print(plot_curves(runs, a.out, a.keys))
    else:
        probes = {name: probe_model(path, a.data, limit=a.limit, bins=a.bins) for name, path in _named(a.models)}
        if a.json:
            Path(a.json).write_text(json.dumps(probes, indent=1))
        print(plot_probe(probes, a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
