"""The digit-distribution probe: for each model, teacher-forced on the eval rows, the predicted
distribution over the numeric tokens (softmax over the numeric vocabulary's columns only, i.e.
renormalised) at every position whose label is numeric, averaged per target value: a heatmap with
rows = target value, cols = predicted value, one panel per run. A model that has learned "numbers near
the target" shows a bright band around the diagonal. With more than `bins` distinct values
(Llama-3-style N=1000 vocabularies) the values are grouped into `bins` equal-width bins over the value
range: a row is then the mean, over target positions in that bin, of the probability mass that falls in
each predicted bin. Every row sums to 1 (rows with no position are NaN and drawn blank).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from data_prep.shards import read_manifest

from .evaluate import load_rows
from .generation import load_model


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
    `recipes.evaluation.evaluate.load_rows` returns. Returns {"labels": bin labels, "matrix": [[...]] (rows =
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
