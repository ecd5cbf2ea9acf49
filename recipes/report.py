"""Reports across runs: a Markdown results table, training curves, and the digit-distribution probe.

    python -m recipes.report table runs/*/eval_results.json > table.md
    python -m recipes.report curves ce=runs/ce/metrics.jsonl smmd=runs/smmd/metrics.jsonl --out curves.png
    python -m recipes.report probe ce=runs/ce/final smmd=runs/smmd/final --data DATA --out probe.png

- table: one row per results JSON written by `recipes.evaluate`, one column per metric any of them
  reports (n, parse rate, exact match, MAE, R², time gap, relaxed accuracy), each followed by the
  number of rows it used when the results say it; "–" where a run has none; with `interval=True` exact
  match carries its 95% Wilson interval.
- intervals: `wilson_interval` (one run's exact match over n problems) and `paired_bootstrap` (the
  difference of two runs' exact match over the same problems, resampling problems).
- curves: `metrics.jsonl` (one JSON object per optimizer step, as recipes/train.py writes it:
  "step", "loss", "ce", "term/<name>", "lr", ...); one panel per quantity (loss, ce, then each term),
  one line per run. Quantities a run does not log are simply absent from its panels.
- probe: for each model, teacher-forced on the eval rows, the predicted distribution over the numeric
  tokens (softmax over the numeric vocab's columns only, i.e. renormalised) at every position whose
  label is numeric, averaged per target value: a heatmap with rows = target value, cols = predicted
  value, one panel per run. A model that has learned "numbers near the target" shows a bright band
  around the diagonal. With more than `bins` distinct values (Llama-3-style N=1000 vocabularies) the
  values are grouped into `bins` equal-width bins over the value range: a row is then the mean, over
  target positions in that bin, of the probability mass that falls in each predicted bin. Every row
  sums to 1 (rows with no position are NaN and drawn blank).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np

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
_SKIP = {"n_text"}  # in n_exact_match


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


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval of a proportion (95% for the default z). Unlike the normal
    approximation it stays inside [0, 1] and is not empty at 0 or n successes, which is where a
    zero-shot model's exact match sits."""
    if n <= 0:
        raise ValueError(f"wilson_interval: n must be positive, got {n}")
    if not 0 <= successes <= n:
        raise ValueError(f"wilson_interval: {successes} successes out of {n}")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_bootstrap(a: Sequence[float], b: Sequence[float], resamples: int = 10000, seed: int = 0,
                     level: float = 0.95) -> dict:
    """mean(a) - mean(b) over the same problems, with a percentile bootstrap interval.

    `a[i]` and `b[i]` are two systems' scores on problem i (1/0 correct, or a mean over seeds): the
    per-problem differences are resampled with replacement, so what the two share (a problem both get
    right or both miss) cancels, which makes the interval much tighter than two separate ones.
    Returns {"diff", "low", "high", "n", "p_le_0"} (p_le_0: share of resamples with a difference
    <= 0, a one-sided bootstrap p-value for "a beats b")."""
    if len(a) != len(b):
        raise ValueError(f"paired_bootstrap: {len(a)} scores against {len(b)}; pair them over the same problems")
    if not len(a):
        raise ValueError("paired_bootstrap: no problems")
    diff = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    for start in range(0, resamples, 1000):  # 1000 resamples at a time bounds the index matrix
        k = min(1000, resamples - start)
        means[start:start + k] = diff[rng.integers(0, len(diff), size=(k, len(diff)))].mean(axis=1)
    tail = (1 - level) / 2
    return {"diff": float(diff.mean()), "low": float(np.quantile(means, tail)),
            "high": float(np.quantile(means, 1 - tail)), "n": len(diff), "p_le_0": float((means <= 0).mean())}


def markdown_table(results: Sequence[dict], interval: bool = False) -> str:
    """One row per run (its `name`), one column per metric present in any run. `interval`: exact
    match as "value [low, high]" with its 95% Wilson interval over the rows exact match used."""
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
                low, high = wilson_interval(round(m[k] * scored), scored)
                cell += f" [{low:.3f}, {high:.3f}]"
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
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


def curve_keys(runs: dict[str, list[dict]]) -> list[str]:
    """Quantities to draw: loss, ce, then every term/<name> any run logs."""
    keys = ["loss", "ce"]
    terms = sorted({k for rows in runs.values() for r in rows for k in r if k.startswith("term/")})
    present = {k for rows in runs.values() for r in rows for k in r}
    return [k for k in keys if k in present] + terms


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
        for i, (name, rows) in enumerate(runs.items()):
            pts = [(r["step"], r[key]) for r in rows if key in r and r[key] is not None and "step" in r]
            if pts:  # a run keeps its colour in every panel, also in those where the others have no line
                xs, ys = zip(*pts)
                ax.plot(xs, ys, label=name, linewidth=1.2, color=f"C{i % 10}")
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# ---- digit-distribution probe -------------------------------------------------------------------------


def value_bins(values: np.ndarray, bins: int) -> tuple[np.ndarray, list[str]]:
    """(bin index of each numeric column, label of each bin). One bin per distinct value when there
    are at most `bins` of them; else `bins` equal-width bins over [min, max]."""
    uniq = np.unique(values)
    if len(uniq) <= bins:
        index = np.searchsorted(uniq, values)
        return index, [f"{v:g}" for v in uniq]
    lo, hi = float(uniq[0]), float(uniq[-1])
    edges = np.linspace(lo, hi, bins + 1)
    index = np.clip(np.searchsorted(edges, values, side="right") - 1, 0, bins - 1)
    labels = [f"{edges[i]:g}–{edges[i + 1]:g}" for i in range(bins)]
    return index, labels


def probe_distribution(model, rows: Sequence[dict], token_ids: Sequence[int], values: Sequence[float],
                       bins: int = 20, batch_size: int = 8) -> dict:
    """Mean renormalised numeric distribution at numeric label positions, grouped by target value.

    `rows`: dicts with "input_ids" and "labels" (unshifted, -100 on the prompt), as
    `recipes.evaluate.load_rows` returns. Returns {"labels": bin labels, "matrix": [[...]] (rows =
    target bin, cols = predicted bin; each row sums to 1, NaN rows where no position),
    "counts": positions per target bin, "positions": total}.
    """
    import torch

    token_ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    values = np.asarray(values, dtype=np.float64)
    col_bin, labels = value_bins(values, bins)
    nb = len(labels)
    col_bin_t = torch.as_tensor(col_bin, dtype=torch.long)
    lookup = {int(t): i for i, t in enumerate(token_ids.tolist())}
    device = next(model.parameters()).device
    sums = torch.zeros(nb, nb, dtype=torch.float64)
    counts = torch.zeros(nb, dtype=torch.float64)
    model.eval()
    for b in range(0, len(rows), batch_size):
        chunk = rows[b:b + batch_size]
        width = max(len(r["input_ids"]) for r in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        labels_t = torch.full((len(chunk), width), -100, dtype=torch.long)
        for j, r in enumerate(chunk):  # right padding: positions stay 0.. for every row
            n = len(r["input_ids"])
            ids[j, :n] = torch.as_tensor(r["input_ids"], dtype=torch.long)
            labels_t[j, :n] = torch.as_tensor(r["labels"], dtype=torch.long)
            mask[j, :n] = 1
        with torch.no_grad():
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        logits, targets = logits[:, :-1].float().cpu(), labels_t[:, 1:]
        col = torch.full_like(targets, -1)
        for tid, c in lookup.items():
            col[targets == tid] = c
        sel = col >= 0
        if not sel.any():
            continue
        # renormalised over the N numeric columns in float64, so each row of the matrix sums to 1
        # to rounding of doubles (a float32 softmax left rows 1.2e-7 off)
        p = torch.softmax(logits[sel][:, token_ids].double(), dim=-1)  # [M, N]
        pb = torch.zeros(p.shape[0], nb, dtype=torch.float64).index_add_(1, col_bin_t, p)  # [M, nb]
        tb = col_bin_t[col[sel]]
        sums.index_add_(0, tb, pb)
        counts.index_add_(0, tb, torch.ones_like(tb, dtype=torch.float64))
    matrix = torch.where(counts[:, None] > 0, sums / counts.clamp(min=1)[:, None], torch.nan)
    return {"labels": labels, "matrix": matrix.tolist(), "counts": counts.long().tolist(),
            "positions": int(counts.sum().item())}


def probe_model(model_dir: str, data_dir: str, limit: int | None = 256, bins: int = 20,
                batch_size: int = 8, device: str | None = None) -> dict:
    """`probe_distribution` for a saved model on a data_prep directory (numeric vocab from its manifest)."""
    from recipes.evaluate import load_model, load_rows, read_manifest

    manifest = read_manifest(data_dir)
    nv = manifest["numeric_vocab"]
    rows = load_rows(data_dir, limit)
    if any(r["image"] for r in rows):
        raise ValueError("probe: image rows are not supported (text-only teacher forcing)")
    model, _, _ = load_model(model_dir, device=device)
    return probe_distribution(model, rows, nv["token_ids"], nv["values"], bins=bins, batch_size=batch_size)


def plot_probe(probes: dict[str, dict], out: str) -> str:
    """One heatmap panel per run: rows = target value (bin), cols = predicted value (bin)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(probes)
    if not n:
        raise ValueError("no probes to plot")
    fig, axes = plt.subplots(1, n, figsize=(4.4 * n + 0.8, 4.4), squeeze=False)
    im = None
    for ax, (name, pr) in zip(axes[0], probes.items()):
        mat = np.array(pr["matrix"], dtype=float)
        im = ax.imshow(np.ma.masked_invalid(mat), vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
        labels = pr["labels"]
        step = max(1, len(labels) // 10)
        ticks = list(range(0, len(labels), step))
        ax.set_xticks(ticks, [labels[i] for i in ticks], rotation=60, fontsize=7)
        ax.set_yticks(ticks, [labels[i] for i in ticks], fontsize=7)
        ax.set_xlabel("predicted value")
        ax.set_ylabel("target value")
        ax.set_title(f"{name} ({pr['positions']} positions)", fontsize=9)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="mean probability (numeric vocab)")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


# ---- command line -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m recipes.report", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("table", help="Markdown table of results JSON files (one row per run)")
    t.add_argument("results", nargs="+")
    t.add_argument("--out", default=None, help="write here instead of stdout")
    c = sub.add_parser("curves", help="training curves from metrics.jsonl files")
    c.add_argument("runs", nargs="+", help="[NAME=]metrics.jsonl")
    c.add_argument("--out", required=True)
    c.add_argument("--keys", nargs="*", default=None, help="quantities to draw (default: loss, ce, term/*)")
    q = sub.add_parser("probe", help="digit-distribution heatmaps, one panel per model")
    q.add_argument("models", nargs="+", help="[NAME=]model_dir")
    q.add_argument("--data", required=True)
    q.add_argument("--out", required=True)
    q.add_argument("--limit", type=int, default=256)
    q.add_argument("--bins", type=int, default=20)
    q.add_argument("--json", default=None, help="also write the probe matrices here")
    a = p.parse_args(argv)
    if a.cmd == "table":
        text = markdown_table(load_results(a.results))
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
