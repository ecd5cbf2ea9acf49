"""The small-scale replication study: every numeric loss against CE on multi-digit arithmetic, on CPU.

    python -m recipes.study [--out docs/study] [--work runs/study] [--seeds 3] [--steps N] [--quick]

The same tiny Llama (`recipes/configs/study.yaml`) is trained from scratch under DeepSpeed ZeRO-3 on 2
CPU ranks with each objective, for each seed, on each tokenizer, with the same data, steps and learning
rate; then greedy answers on a held-out split are scored. Two tokenizers: "digits" (every digit a token,
N = 10) and "groups3" (numbers in groups of up to three digits, Llama-3 style, N = 1000; NTIL needs
digits and is left out there). Data: "a + b" and "a - b" with up to 3-digit operands and "a * b" with up
to 2-digit operands from data_prep's generator, deduplicated, split into train and held-out sets with
no problem in both, built into shards by data_prep.

The study resumes: each finished run leaves `<out>/runs/<tokenizer>-<loss>-s<seed>.json` (its eval
metrics and final training metrics) and is skipped when the study is started again; the tables and
plots are rebuilt from those files at the end (`--report-only` rebuilds them without training).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from recipes.local import REPO_ROOT, run_recipe
from recipes.tiny import build_jsonl_shards, train_tokenizer, write_arithmetic_split

RECIPE = REPO_ROOT / "recipes" / "configs" / "study.yaml"
TOKENIZERS = {"digits": ("digits", "digits"), "groups3": ("groups3", "integers")}  # style, numeric policy
LOSSES = {
    "ce": {"terms": {}},
    "ntl_was": {"terms": {"ntl_was": {}}},
    "ntl_mse": {"terms": {"ntl_mse": {}}},
    "gce": {"terms": {"gce": {}}},
    "dist2": {"terms": {"dist2": {}}},
    "ntil": {"terms": {"ntil": {}}},
    "smmd": {"terms": {"smmd": {}}},
    "smmd_mmd": {"terms": {"smmd": {"mode": "mmd"}}},
    "smmd_smooth": {"terms": {"smmd": {"mode": "smooth"}}},
}
ADD_SUB = {"min_digits": 1, "max_digits": 3, "terms": 2, "negatives": False, "decimals": 0, "mixed_ops": 2}
MUL = {**ADD_SUB, "max_digits": 2}


def log(message: str) -> None:
    print(f"[study {time.strftime('%H:%M:%S')}] {message}", flush=True)


def write_problems(out: Path, n_train: int, n_eval: int, seed: int = 0) -> tuple[Path, Path]:
    """Disjoint train / held-out JSONL: two add/sub problems for each multiplication."""
    mix = [("add_or_sub", ADD_SUB), ("add_or_sub", ADD_SUB), ("mul", MUL)]
    return write_arithmetic_split(out, n_train, n_eval, mix, seed)


def build_data(work: Path, n_train: int, n_eval: int) -> None:
    train_jsonl, eval_jsonl = write_problems(work / "problems", n_train, n_eval)
    texts = [p.read_text() for p in (train_jsonl, eval_jsonl)]
    for name, (style, policy) in TOKENIZERS.items():
        root = work / name
        if (root / "data" / "eval" / "manifest.json").exists():
            continue
        train_tokenizer(texts, root / "tokenizer", style=style)
        for split, path in (("train", train_jsonl), ("eval", eval_jsonl)):
            totals = build_jsonl_shards(path, root / "tokenizer", root / "data" / split, numeric_policy=policy)
            log(f"{name}/{split}: {totals['examples_kept']} examples, {totals['numeric_tokens']} numeric labels")


def run_one(work: Path, out: Path, tokenizer: str, loss: str, seed: int, steps: int | None) -> dict:
    from recipes.evaluate import evaluate
    from recipes.report import read_metrics_jsonl

    name = f"{tokenizer}-{loss}-s{seed}"
    run_dir = work / "runs" / name
    policy = TOKENIZERS[tokenizer][1]
    overrides = [f"name={name}", f"train.out_dir={run_dir}", f"train.seed={seed}",
                 f"loss.objective={json.dumps(LOSSES[loss])}", f"loss.numeric_policy={policy}",
                 f"data.train={work / tokenizer / 'data' / 'train'}", f"model.tokenizer={work / tokenizer / 'tokenizer'}"]
    if steps is not None:
        overrides.append(f"train.steps={steps}")
    seconds = run_recipe(RECIPE, overrides, nproc=2, quiet=True)
    results = evaluate(str(run_dir / "final"), str(work / tokenizer / "data" / "eval"), batch_size=100,
                       max_new_tokens=8, name=name)
    curve = read_metrics_jsonl(str(run_dir / "metrics.jsonl"))
    record = {"name": name, "tokenizer": tokenizer, "loss": loss, "seed": seed, "train_seconds": round(seconds, 1),
              "metrics": results["metrics"], "final": curve[-1],
              "curve": [{"step": r["step"], "ce": r["ce"], "loss": r["loss"]} for r in curve]}
    path = out / "runs" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    return record


def aggregate(records: list[dict]) -> list[dict]:
    """Mean and standard deviation over seeds, per (tokenizer, loss), in the study's order."""
    rows = []
    for tokenizer in TOKENIZERS:
        for loss in LOSSES:
            group = [r for r in records if r["tokenizer"] == tokenizer and r["loss"] == loss]
            if not group:
                continue
            row = {"tokenizer": tokenizer, "loss": loss, "seeds": len(group)}
            for key in ("exact_match", "mae", "r2", "parse_rate"):
                values = [r["metrics"][key] for r in group if r["metrics"].get(key) is not None]
                row[key] = statistics.mean(values) if values else None
                row[key + "_sd"] = statistics.stdev(values) if len(values) > 1 else None
                row[key + "_n"] = len(values)  # MAE and R² exist only for seeds with parsed answers
            row["final_ce"] = statistics.mean(r["final"]["ce"] for r in group)
            rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    def cell(row, key, scale=1.0, digits=2):
        if row[key] is None:
            return "n/a"
        def number(x):  # a diverged run's MAE can be 1e23: scientific, not 24 digits
            return f"{x * scale:.{digits}f}" if abs(x * scale) < 1e6 else f"{x * scale:.2e}"

        value = number(row[key])
        if row[key + "_sd"] is None:
            return f"{value} (1 seed)"
        spread = f" ± {number(row[key + '_sd'])}"
        return value + spread + (f" ({row[key + '_n']} seeds)" if row[key + "_n"] < row["seeds"] else "")

    lines = ["Mean ± sample standard deviation over seeds; MAE and R² over parsed answers only.", "",
             "| tokenizer | loss | seeds | exact match % | MAE | R² | parse rate % | final train CE |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['tokenizer']} | {row['loss']} | {row['seeds']} | {cell(row, 'exact_match', 100, 1)}"
                     f" | {cell(row, 'mae')} | {cell(row, 'r2', 1, 3)} | {cell(row, 'parse_rate', 100, 1)}"
                     f" | {row['final_ce']:.3f} |")
    return "\n".join(lines)


def report(work: Path, out: Path, probe: bool = True) -> str:
    """Tables, CSV, learning curves and the probe from the finished runs' records."""
    import csv

    from recipes.report import plot_curves, plot_probe, probe_model

    records = [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]
    rows = aggregate(records)
    table = markdown(rows)
    (out / "results.md").write_text(table + "\n")
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    for tokenizer in TOKENIZERS:
        curves = {r["loss"]: r["curve"] for r in records if r["tokenizer"] == tokenizer and r["seed"] == 0}
        if curves:
            plot_curves(curves, str(out / f"curves-{tokenizer}.png"), keys=["ce"])
        if probe:
            probes = {}
            for r in records:
                model_dir = work / "runs" / r["name"] / "final"
                if r["tokenizer"] == tokenizer and r["seed"] == 0 and model_dir.exists():
                    probes[r["loss"]] = probe_model(str(model_dir), str(work / tokenizer / "data" / "eval"), limit=300)
            if probes:
                plot_probe(probes, str(out / f"probe-{tokenizer}.png"))
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.study", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(REPO_ROOT / "docs" / "study"), help="results (committed)")
    parser.add_argument("--work", default=str(REPO_ROOT / "runs" / "study"), help="data, checkpoints, models")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None, help="override train.steps of the study recipe")
    parser.add_argument("--train-examples", type=int, default=20000)
    parser.add_argument("--eval-examples", type=int, default=600)
    parser.add_argument("--losses", default=",".join(LOSSES), help="comma-separated subset")
    parser.add_argument("--tokenizers", default=",".join(TOKENIZERS), help="comma-separated subset")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args(argv)
    work, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    if not args.report_only:
        build_data(work, args.train_examples, args.eval_examples)
        grid = [(t, loss, s) for s in range(args.seeds) for t in args.tokenizers.split(",")
                for loss in args.losses.split(",") if not (loss == "ntil" and TOKENIZERS[t][1] != "digits")]
        started = time.time()
        for i, (tokenizer, loss, seed) in enumerate(grid, 1):
            if (out / "runs" / f"{tokenizer}-{loss}-s{seed}.json").exists():
                continue
            record = run_one(work, out, tokenizer, loss, seed, args.steps)
            elapsed = time.time() - started
            m = record["metrics"]
            log(f"{i}/{len(grid)} {record['name']}: exact match {m['exact_match']}, MAE {m['mae']},"
                f" parse rate {m['parse_rate']} ({record['train_seconds']:.0f} s; {elapsed / 60:.1f} min so far)")
    print(report(work, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
