"""recipes.evaluation.report: the results table, training curves, the digit-distribution probe."""

import json

import numpy as np
import torch

from recipes.evaluation import probe as P
from recipes.evaluation import report as R

PNG = b"\x89PNG\r\n\x1a\n"


def _png_ok(path):
    data = open(path, "rb").read()
    return len(data) > 1000 and data.startswith(PNG)


def test_table_has_a_row_per_run_and_dashes_where_a_metric_is_missing(tmp_path):
    paths = []
    for name, metrics in [("ce", {"n": 10, "exact_match": 0.5, "mae": 1.25, "r2": float("nan")}),
                          ("clock", {"n": 4, "exact_match": 0.25, "time_gap": 8.5})]:
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps({"name": name, "metrics": metrics}))
        paths.append(str(p))
    lines = R.markdown_table(R.load_results(paths)).strip().splitlines()
    assert len(lines) == 2 + 2
    assert lines[0] == "| run | n | exact match | MAE | R² | time gap (min) |"
    assert lines[2] == "| ce | 10 | 0.5 | 1.25 | – | – |"
    assert lines[3] == "| clock | 4 | 0.25 | – | – | 8.5 |"


def test_curves_one_line_per_run_and_a_panel_per_term(tmp_path):
    runs = {}
    for name, terms in [("ce", {}), ("smmd", {"term/smmd": 0.5})]:
        path = tmp_path / name / "metrics.jsonl"
        path.parent.mkdir()
        with path.open("w") as fh:
            for step in range(1, 21):
                fh.write(json.dumps({"step": step, "loss": 3 / step, "ce": 2.5 / step, "lr": 1e-4,
                                     "grad_norm": 1.0, "tokens_per_s": 100.0,
                                     **{k: v / step for k, v in terms.items()}}) + "\n")
            fh.write('{"step": 21, "lo')  # a run killed mid-write: the partial line is skipped
        runs[name] = str(path)
    data = {n: R.read_metrics_jsonl(p) for n, p in runs.items()}
    assert len(data["ce"]) == 20
    assert R.curve_keys(data) == ["loss", "ce", "term/smmd"]
    out = tmp_path / "curves.png"
    assert R.main(["curves", f"ce={runs['ce']}", runs["smmd"], "--out", str(out)]) == 0
    assert _png_ok(out)


def test_curves_draw_the_gradient_shares_in_one_panel(tmp_path, monkeypatch):
    """Runs that logged gradient diagnostics (every other step) get one more panel: every part's share."""
    rows = [{"step": s, "loss": 1.0 / s, "ce": 0.5 / s, "term/smmd": 0.1,
             **({"grad/ce/share": 0.4, "grad/smmd/share": 0.6, "grad/smmd/cos_ce": 0.2} if s % 2 == 0 else {})}
            for s in range(1, 11)]
    runs = {"smmd": rows, "ce": [{"step": s, "loss": 1.0, "ce": 1.0, "grad/ce/share": 1.0} for s in (2, 4)]}
    assert R.curve_keys(runs) == ["loss", "ce", "term/smmd", R.SHARES]
    assert R.curve_keys({"old": [{"step": 1, "loss": 1.0}]}) == ["loss"]
    drawn = []
    monkeypatch.setattr(R, "_plot_shares", lambda ax, r: drawn.append(R._share_parts(r)) or ax.plot([1], [0.5]))
    assert _png_ok(R.plot_curves(runs, str(tmp_path / "curves.png")))
    assert drawn == [["ce", "smmd"]]


def test_probe_rows_sum_to_one_on_a_real_model(rec_model_dir, rec_data_dir, tmp_path):
    probe = P.probe_model(rec_model_dir, rec_data_dir, limit=None)
    mat = np.array(probe["matrix"])
    assert mat.shape == (10, 10) and probe["labels"] == [str(d) for d in range(10)]
    seen = np.array(probe["counts"]) > 0
    assert probe["positions"] == sum(probe["counts"]) > 0
    np.testing.assert_allclose(mat[seen].sum(axis=1), 1.0, atol=1e-9)
    assert np.isnan(mat[~seen]).all()
    out = tmp_path / "probe.png"
    P.plot_probe({"a": probe, "b": probe}, str(out))
    assert _png_ok(out)


class _FixedLogits(torch.nn.Module):
    """A "model" whose logits at position t put `sharp` on the label at t+1 (plus noise)."""

    def __init__(self, vocab, sharp, labels_by_row):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.vocab, self.sharp, self.rows = vocab, sharp, labels_by_row

    def forward(self, input_ids, attention_mask):
        b, t = input_ids.shape
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(b, t, self.vocab, generator=g)
        for j in range(b):
            key = tuple(input_ids[j][attention_mask[j] > 0].tolist())
            labels = self.rows[key]
            for i in range(len(labels) - 1):
                if labels[i + 1] >= 0:
                    logits[j, i, labels[i + 1]] += self.sharp
        return type("Out", (), {"logits": logits})()


def test_probe_bins_a_thousand_values_and_a_sharp_model_is_diagonal():
    vocab = 1100
    token_ids, values = list(range(100, 1100)), list(range(1000))  # N = 1000 "integers" tokens
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(40):
        nums = rng.integers(100, 1100, size=3).tolist()
        ids = [1, 2, 3] + nums + [4]
        rows.append({"input_ids": ids, "labels": [-100, -100, -100] + nums + [4]})
    model = _FixedLogits(vocab, 30.0, {tuple(r["input_ids"]): r["labels"] for r in rows})
    probe = P.probe_distribution(model, rows, token_ids, values, bins=20, batch_size=7)
    mat = np.array(probe["matrix"])
    assert mat.shape == (20, 20) and len(probe["labels"]) == 20 and probe["positions"] == 120
    seen = np.array(probe["counts"]) > 0
    np.testing.assert_allclose(mat[seen].sum(axis=1), 1.0, atol=1e-9)
    assert (np.diag(mat)[seen] > 0.99).all()  # all the mass in the target's own bin


def test_value_bins_keep_distinct_values_when_few():
    idx, labels = P.value_bins(np.array([3.0, 1.0, 2.0, 1.0]), bins=20)
    assert labels == ["1", "2", "3"] and idx.tolist() == [2, 0, 1, 0]
    idx, labels = P.value_bins(np.arange(1000.0), bins=20)
    assert len(labels) == 20 and idx.min() == 0 and idx.max() == 19 and np.bincount(idx).tolist() == [50] * 20
