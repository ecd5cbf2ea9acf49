"""Study B (docs/study-lowdata/, pre-registered there): a numeric regression with little data.

    python -m recipes.lowdata [--out DIR] [--work DIR] [--seeds 5] [--n 32,128,512,2048] [--arms ce,...]
                              [--steps 2000] [--test-size 1000] [--budget-min M] [--report-only]

A hidden linear map `y = round(3.7·a + 6.4·b)` of two inputs 0..99; 1,000 test inputs drawn once, the
same for every cell; at seed s the training inputs are the first N of a permutation of the other 9,000
(nested over N). The from-scratch study's 1M Llama (`recipes/configs/study.yaml`) is trained by
`recipes.train` on one CPU rank for 2,000 steps of 32, per (N, arm, seed) cell, then answers the test
inputs greedily; the record keeps every answer, so closeness pairs by seed and input.

Resumable by cell: a cell whose record `<out>/runs/n<N>-<arm>-s<seed>.json` exists is skipped (and the
log says so); cells run N by N, every seed of an N before the next. `--report-only` rebuilds
`results.md`, `results.csv` and `closeness.png` from the records alone. A comparison is reported only
when both arms have every planned seed (`REPORT_SEEDS`); Holm's adjustment only when the whole primary
family is complete.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

from recipes.evaluation.evaluate import evaluate
from recipes.evaluation.metrics import closeness, closeness_per_problem, miss_error_for
from recipes.evaluation.report import read_metrics_jsonl
from recipes.evaluation.stats import holm, paired_t_p, seed_t_interval, two_level_bootstrap
from recipes.experiments.local import REPO_ROOT, run_recipe
from recipes.experiments.tiny import build_jsonl_shards, train_tokenizer

OUT = REPO_ROOT / "docs" / "study-lowdata"
WORK = REPO_ROOT / "runs" / "study-lowdata"
RECIPE = REPO_ROOT / "recipes" / "configs" / "study.yaml"
COEFFICIENTS = (3.7, 6.4)  # y = round(3.7 a + 6.4 b): 0..1,000 for a, b in 0..99
INPUT_RANGE = 100
N_VALUES = (32, 128, 512, 2048)
SEEDS = 5
REPORT_SEEDS = 5  # a comparison is reported only with this many seeds of both arms (pre-registered)
STEPS = 2000
BATCH = 32
TEST_SIZE = 1000
MAX_NEW_TOKENS = 6
CONTROL = "numeric_smoothing"
ARMS = {
    "ce": {"terms": {}},
    "dist2": {"terms": {"dist2": {"weight": 0.1}}},  # paper mode: full probabilities, tau 1, no weighting
    "dist2_code": {"terms": {"dist2": {"weight": 1.0, "tau": 2.0, "normalize": "numeric", "weighting": "place_value"}}},
    "ntl_was": {"terms": {"ntl_was": {"weight": 0.3}}},
    "smmd": {"terms": {"smmd": {"weight": 0.3}}},
    CONTROL: {"terms": {CONTROL: {"weight": 0.1}}},
}
PRIMARY_TERMS = ("dist2", "dist2_code", "ntl_was", "smmd")
ENDPOINTS = ("log_mae", "exact_match")  # primary; the lower log-MAE the better, the higher exact match


def log(message: str) -> None:
    print(f"[lowdata {time.strftime('%H:%M:%S')}] {message}", flush=True)


def target(a: int, b: int) -> int:
    return round(COEFFICIENTS[0] * a + COEFFICIENTS[1] * b)


def draws(test_size: int = TEST_SIZE) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(test inputs, the rest), the test inputs drawn once with a fixed seed."""
    pairs = [(a, b) for a in range(INPUT_RANGE) for b in range(INPUT_RANGE)]
    random.Random("lowdata-test").shuffle(pairs)
    return pairs[:test_size], pairs[test_size:]


def training_inputs(rest: list[tuple[int, int]], seed: int, n: int) -> list[tuple[int, int]]:
    """The first n of seed's permutation of `rest`: nested over n at one seed."""
    order = list(rest)
    random.Random(f"lowdata-train:{seed}").shuffle(order)
    if n > len(order):
        raise ValueError(f"N = {n} training inputs asked, {len(order)} exist outside the test set")
    return order[:n]


def write_jsonl(path: Path, pairs) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": f"{a} {b}", "target": str(target(a, b))}) + "\n" for a, b in pairs))
    return path


def prepare(work: Path, test_size: int) -> dict:
    """The tokenizer (trained once on every input and answer) and the test shards; returns the paths."""
    test, rest = draws(test_size)
    tokenizer = work / "tokenizer"
    eval_dir = work / "data" / f"test-{test_size}"
    if not (eval_dir / "manifest.json").exists():
        if not (tokenizer / "tokenizer.json").exists():
            everything = write_jsonl(work / "problems" / "all.jsonl", test + rest)
            train_tokenizer([everything.read_text()], tokenizer, style="digits")
        build_jsonl_shards(write_jsonl(work / "problems" / f"test-{test_size}.jsonl", test), tokenizer, eval_dir)
    return {"tokenizer": tokenizer, "eval": eval_dir, "rest": rest}


def train_shards(work: Path, paths: dict, seed: int, n: int) -> Path:
    out = work / "data" / f"train-s{seed}-n{n}"
    if not (out / "manifest.json").exists():
        jsonl = write_jsonl(work / "problems" / f"train-s{seed}-n{n}.jsonl", training_inputs(paths["rest"], seed, n))
        build_jsonl_shards(jsonl, paths["tokenizer"], out)
    return out


def cell_name(n: int, arm: str, seed: int) -> str:
    return f"n{n}-{arm}-s{seed}"


def grid(seeds: int, ns, arms) -> list[tuple[int, str, int]]:
    """(N, arm, seed) cells, N by N (smallest first), every seed of an N before the next N."""
    return [(n, arm, s) for n in ns for s in range(seeds) for arm in arms]


def convergence(curve: list[dict], window: int = 200) -> dict | None:
    """Mean training CE over the last `window` steps and its change from the `window` before."""
    ces = [r["ce"] for r in curve if r.get("ce") is not None]
    if len(ces) < 2 * window:
        window = len(ces) // 2
    if window < 1:
        return None
    last, before = statistics.mean(ces[-window:]), statistics.mean(ces[-2 * window:-window])
    return {"window": window, "final_ce": last, "change": last - before}


def run_cell(work: Path, out: Path, paths: dict, n: int, arm: str, seed: int, steps: int) -> dict:
    """Train, answer and record one cell; the run's folder (model, checkpoint) is removed after."""
    name = cell_name(n, arm, seed)
    run_dir = work / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)  # a cell killed half-way starts again from nothing
    settings = [f"name={name}", f"train.out_dir={run_dir}", f"train.seed={seed}", f"train.steps={steps}",
                f"loss.objective={json.dumps(ARMS[arm])}", "loss.numeric_policy=digits",
                f"data.train={train_shards(work, paths, seed, n)}", f"model.tokenizer={paths['tokenizer']}",
                f"train.micro_batch_size={BATCH}", f"train.global_batch_size={BATCH}",
                "cluster.cpu_ranks_per_node=1", "deepspeed.zero_stage=0"]
    seconds = run_recipe(RECIPE, settings, nproc=1, quiet=True)
    started = time.time()
    results = evaluate(str(run_dir / "final"), str(paths["eval"]), batch_size=100, max_new_tokens=MAX_NEW_TOKENS,
                       name=name)
    examples = results["examples"]
    answers = [e["prediction"] for e in examples]
    targets = [e["target"] for e in examples]
    curve = read_metrics_jsonl(str(run_dir / "metrics.jsonl"))
    record = {"name": name, "n": n, "arm": arm, "seed": seed, "steps": steps, "objective": ARMS[arm],
              "train_seconds": round(seconds, 1), "eval_seconds": round(time.time() - started, 1),
              "metrics": results["metrics"], "closeness": closeness(answers, targets, miss_error_for(targets)),
              "convergence": convergence(curve),
              "eval_ids_sha256": hashlib.sha256("\n".join(str(e["example_id"]) for e in examples).encode()).hexdigest(),
              "answers": answers, "targets": targets,
              "curve": [{k: r[k] for k in ("step", "ce", "loss") if k in r} for r in curve
                        if r["step"] % 10 == 0 or r["step"] == curve[-1]["step"]]}
    path = out / "runs" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(record, indent=0))
    partial.replace(path)  # a record exists whole or not at all: the skip rule reads only its presence
    shutil.rmtree(run_dir, ignore_errors=True)
    return record


# ---- the report, from the records alone ------------------------------------------------------------------


def read_records(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]


def per_problem(record: dict) -> dict[str, list[float]]:
    """Each endpoint's score per test input (log-MAE: log(1 + |error|), unparsed at the set's miss error)."""
    rows = closeness_per_problem(record["answers"], record["targets"], record["closeness"]["miss_error"])
    return {"log_mae": [r["log_error"] for r in rows],
            "exact_match": [float(r["parsed"] is not None and r["abs_error"] <= 1e-9) for r in rows]}


def compare(mine: list[dict], theirs: list[dict], endpoint: str) -> dict:
    """Arm minus baseline over their common seeds: per-seed differences, t interval and p, bootstrap."""
    by_seed = {r["seed"]: r for r in theirs}
    pairs = [(r, by_seed[r["seed"]]) for r in sorted(mine, key=lambda r: r["seed"]) if r["seed"] in by_seed]
    if len({r["eval_ids_sha256"] for pair in pairs for r in pair}) > 1:
        raise ValueError(f"{pairs[0][0]['name']}: its comparison mixes test sets")
    a = [per_problem(m)[endpoint] for m, _ in pairs]
    b = [per_problem(t)[endpoint] for _, t in pairs]
    boot = two_level_bootstrap(a, b)
    return {"seeds": len(pairs), "diff": boot["diff"], "per_seed": boot["per_seed"], "t": boot["seed_t"],
            "p": paired_t_p(boot["per_seed"]), "boot_low": boot["low"], "boot_high": boot["high"]}


def comparisons(records: list[dict], seeds: int = REPORT_SEEDS) -> list[dict]:
    """Every term against CE and against the control, at each N, where both have `seeds` seeds; the
    primary family's p-values Holm-adjusted when all of them are there."""
    cells: dict[tuple[int, str], list[dict]] = {}
    for r in records:
        cells.setdefault((r["n"], r["arm"]), []).append(r)
    out = []
    for n in sorted({r["n"] for r in records}):
        for arm in ARMS:
            for base in ("ce", CONTROL):
                if arm in ("ce", base) or (base == CONTROL and arm not in PRIMARY_TERMS):
                    continue
                mine, theirs = cells.get((n, arm), []), cells.get((n, base), [])
                common = {r["seed"] for r in mine} & {r["seed"] for r in theirs}
                if len(common) < seeds:
                    continue
                for endpoint in ENDPOINTS:
                    row = {"n": n, "arm": arm, "vs": base, "endpoint": endpoint,
                           "primary": base == "ce" and arm in PRIMARY_TERMS,
                           **compare([r for r in mine if r["seed"] in common], theirs, endpoint)}
                    out.append(row)
    family = {(r["n"], r["arm"], r["endpoint"]): r["p"] for r in out if r["primary"]}
    complete = len(family) == len(N_VALUES) * len(PRIMARY_TERMS) * len(ENDPOINTS)
    adjusted = holm(family) if complete else {}
    for r in out:
        r["holm_p"] = adjusted.get((r["n"], r["arm"], r["endpoint"])) if r["primary"] else None
    return out


def summary_rows(records: list[dict]) -> list[dict]:
    rows = []
    for n in sorted({r["n"] for r in records}):
        for arm in ARMS:
            group = [r for r in records if r["n"] == n and r["arm"] == arm]
            if not group:
                continue
            row = {"n": n, "arm": arm, "seeds": len(group), "n_test": group[0]["closeness"]["n"]}
            for key, values in (("exact_match", [r["metrics"]["exact_match"] for r in group]),
                                ("log_mae", [r["closeness"]["log_mae"] for r in group]),
                                ("median_abs_error", [r["closeness"]["median_abs_error"] for r in group]),
                                ("within_1pct", [r["closeness"]["within_1pct"] for r in group]),
                                ("parse_rate", [r["closeness"]["parse_rate"] for r in group]),
                                ("final_ce", [r["convergence"]["final_ce"] for r in group]),
                                ("ce_change", [r["convergence"]["change"] for r in group]),
                                ("train_seconds", [r["train_seconds"] for r in group])):
                row[key] = statistics.mean(values)
                row[key + "_sd"] = statistics.stdev(values) if len(values) > 1 else None
            rows.append(row)
    return rows


def markdown(rows: list[dict], compared: list[dict], planned: list[str], done: set[str]) -> str:
    def pm(row, key, scale=1.0, digits=2):
        sd = row[key + "_sd"]
        return f"{scale * row[key]:.{digits}f}" + ("" if sd is None else f" ± {scale * sd:.{digits}f}")

    n_test = rows[0]["n_test"] if rows else 0
    lines = [f"Cells done: {len(done & set(planned))} of {len(planned)} planned.", "",
             f"Per cell group: mean ± sample SD over its seeds, the endpoints shown once all {REPORT_SEEDS} exist. "
             f"log-MAE: mean log(1 + |ŷ − y|) over all {n_test} test inputs, an unparsed answer at the test "
             "targets' span; final CE: mean training CE over the last 200 steps, Δ: its change from the 200 "
             "before (convergence).", "",
             "| N | arm | seeds | exact match % | log-MAE | median abs error | within 1% % | parse rate % "
             "| final train CE | Δ train CE | train s |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["seeds"] < REPORT_SEEDS:  # the endpoints of an arm wait for all its seeds (pre-registered)
            scores = " | ".join([f"– ({r['seeds']} of {REPORT_SEEDS} seeds)"] * 5)
        else:
            scores = (f"{pm(r, 'exact_match', 100, 1)} | {pm(r, 'log_mae')} | {pm(r, 'median_abs_error', 1, 1)} "
                      f"| {pm(r, 'within_1pct', 100, 1)} | {pm(r, 'parse_rate', 100, 1)}")
        lines.append(f"| {r['n']} | {r['arm']} | {r['seeds']} | {scores} | {pm(r, 'final_ce', 1, 3)} "
                     f"| {pm(r, 'ce_change', 1, 4)} | {r['train_seconds']:.0f} |")
    lines += ["", f"Comparisons (only where both arms have all {REPORT_SEEDS} seeds): arm minus baseline, "
              "exact match in points, log-MAE in nats (negative: closer). t: the 95% t interval over the "
              "per-seed differences (4 df) and its two-sided p; Holm: the p adjusted over the 32 primary "
              "comparisons (terms vs CE), shown once all 32 exist; bootstrap: the 95% two-level interval "
              "(seeds, then test inputs)."]
    if not compared:
        lines += ["", "None yet: no comparison has all its seeds."]
        return "\n".join(lines)
    lines += ["", "| N | arm | vs | endpoint | Δ | per seed | 95% t over seeds | p (t) | Holm p "
              "| 95% bootstrap seeds × inputs |", "|---:|---|---|---|---:|---|---|---:|---:|---|"]
    for c in compared:
        scale = 100.0 if c["endpoint"] == "exact_match" else 1.0
        num = (lambda x: f"{scale * x:+.1f}") if scale == 100 else (lambda x: f"{x:+.3f}")
        holm_p = "–" if c["holm_p"] is None else f"{c['holm_p']:.3f}"
        lines.append(f"| {c['n']} | {c['arm']} | {c['vs']} | {c['endpoint']}{' (primary)' * c['primary']} "
                     f"| {num(c['diff'])} | {', '.join(num(x) for x in c['per_seed'])} "
                     f"| [{num(c['t']['low'])}, {num(c['t']['high'])}] | {c['p']:.3f} | {holm_p} "
                     f"| [{num(c['boot_low'])}, {num(c['boot_high'])}] |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """log-MAE and exact match against N, one line per arm, at the N where the arm has every seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for arm in ARMS:
        points = [r for r in rows if r["arm"] == arm and r["seeds"] >= REPORT_SEEDS]
        if not points:
            continue
        for ax, key, scale in ((axes[0], "log_mae", 1.0), (axes[1], "exact_match", 100.0)):
            ax.errorbar([r["n"] for r in points], [scale * r[key] for r in points],
                        yerr=[scale * (r[key + "_sd"] or 0) for r in points], label=arm, marker="o", capsize=3)
    for ax, title in zip(axes, ("log-MAE (mean ± SD over seeds)", "exact match % (mean ± SD over seeds)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("training examples N")
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(out: Path, planned: list[str]) -> str:
    import csv

    records = read_records(out)
    rows = summary_rows(records) if records else []
    compared = comparisons(records) if records else []
    table = markdown(rows, compared, planned, {r["name"] for r in records})
    (out / "results.md").write_text(table + "\n")
    if compared:
        with open(out / "results.csv", "w", newline="") as f:
            flat = [{k: (json.dumps(v) if isinstance(v, (dict, list)) else v) for k, v in c.items()} for c in compared]
            writer = csv.DictWriter(f, fieldnames=list(flat[0]))
            writer.writeheader()
            writer.writerows(flat)
    if any(r["seeds"] >= REPORT_SEEDS for r in rows):
        plot(rows, out / "closeness.png")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.lowdata", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(OUT), help="records and report, committed")
    parser.add_argument("--work", default=str(WORK), help="data, tokenizer, the cell being trained")
    parser.add_argument("--seeds", type=int, default=SEEDS)
    parser.add_argument("--n", default=",".join(map(str, N_VALUES)), help="comma-separated training sizes")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--test-size", type=int, default=TEST_SIZE)
    parser.add_argument("--budget-min", type=float, default=None, help="start no new cell after this many minutes")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args(argv)
    arms = args.arms.split(",")
    ns = [int(x) for x in args.n.split(",")]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        parser.error(f"unknown arm {unknown[0]!r}; arms: {list(ARMS)}")
    out, work = Path(args.out), Path(args.work)
    cells = grid(args.seeds, ns, arms)
    planned = [cell_name(*c) for c in cells]
    if not args.report_only:
        paths = prepare(work, args.test_size)
        started = time.time()
        for n, arm, seed in cells:
            name = cell_name(n, arm, seed)
            if (out / "runs" / f"{name}.json").exists():
                log(f"skip {name}: its record exists")
                continue
            if args.budget_min is not None and time.time() - started > 60 * args.budget_min:
                log(f"{args.budget_min:g} min spent: stopping before {name}")
                break
            record = run_cell(work, out, paths, n, arm, seed, args.steps)
            log(f"{name}: exact match {record['metrics']['exact_match']:.3f}, log-MAE "
                f"{record['closeness']['log_mae']:.3f}, train {record['train_seconds']:.0f} s + eval "
                f"{record['eval_seconds']:.0f} s")
    out.mkdir(parents=True, exist_ok=True)
    print(report(out, planned))
    return 0


if __name__ == "__main__":
    sys.exit(main())
