"""The CPU replication studies: every numeric loss against CE on multi-digit arithmetic, all else equal.

    python -m recipes.study [--setup tiny|smollm2] [--out DIR] [--work DIR] [--seeds 3] [--steps N]
                            [--losses ce,smmd,...] [--report-only]

Two setups share this code (`SETUPS`):
- "tiny" (docs/study/): a 1M-parameter Llama (`recipes/configs/study.yaml`) trained from scratch, on
  two tokenizers trained on the fly: "digits" (every digit a token, N = 10) and "groups3" (numbers in
  groups of up to three digits, Llama-3 style, N = 1000; a term that needs digits, NTIL or DEL, is left
  out there: `plan` asks each term's registered needs).
- "smollm2" (docs/study-smollm2/): SmolLM2-135M-Instruct (`recipes.experiments.backbone`, a 4-bit GGUF dequantised
  to fp32) fine-tuned with `recipes/configs/smollm2-study.yaml`, with its own tokenizer (every digit
  a token, N = 10); the backbone's zero-shot answers on the same test problems are the "before" row.
Each objective is trained under DeepSpeed ZeRO-3 on 2 CPU ranks for each seed, with the same data,
steps and learning rate; then greedy answers on a held-out split are scored. Data: "a + b" and
"a - b" with up to 3-digit operands and "a * b" with up to 2-digit operands from data_prep's
generator (two add/sub problems per product), deduplicated, split into train and held-out sets with
no problem in both, built into shards by data_prep (plain template).

The study resumes by run: each finished run leaves `<out>/runs/<tokenizer>-<loss>-s<seed>.json` (its
eval metrics, which test problems it solved, its training curve and speed) and is skipped when the
study is started again, so it can be completed over several invocations; the tables and plots are
rebuilt from those files at the end (`--report-only` rebuilds them without training), and the report
lists the runs of the grid that are done and those still missing. Exact match of each loss is
compared with CE's over the seeds both have run, paired by seed and test problem, by a two-level
bootstrap (`recipes.evaluation.stats.two_level_bootstrap`: seeds resampled, then problems), shown with
the per-seed differences and their t interval: two CE seeds disagree on about as many problems as CE
and another loss do, so an interval over problems alone would rank losses by the luck of a run.
Below 3 seeds the report says no ranking can be read and shows no interval.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from numloss import ObjectiveConfig
from recipes.checks.objective_checks import policy_problems
from recipes.config import read_recipe_file
from recipes.evaluation.evaluate import evaluate
from recipes.evaluation.metrics import closeness, closeness_per_problem
from recipes.evaluation.probe import plot_probe, probe_model
from recipes.evaluation.report import plot_curves, read_metrics_jsonl
from recipes.evaluation.stats import MIN_SEEDS, seed_differences, two_level_bootstrap, versus_cells
from recipes.experiments.backbone import get_backbone
from recipes.experiments.local import REPO_ROOT, run_recipe
from recipes.experiments.tiny import build_jsonl_shards, train_tokenizer, write_arithmetic_split

BACKBONE = "backbone"  # a tokenizer "style": the backbone's own tokenizer, nothing trained
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
    "del": {"terms": {"del": {}}},  # the authors' weight, 0.01
    # 30x: at the backbone's first step DEL is 8.3 against CE 6.6, so 0.3 makes it ~0.4 of CE (0.01: ~0.01)
    "del_0.3": {"terms": {"del": {"weight": 0.3}}},
    # the soft-target control beside CE: a gain a distance-aware term shares with it is one of any soft target
    "numeric_smoothing": {"terms": {"numeric_smoothing": {}}},
}
ADD_SUB = {"min_digits": 1, "max_digits": 3, "terms": 2, "negatives": False, "decimals": 0, "mixed_ops": 2}
MUL = {**ADD_SUB, "max_digits": 2}
MIX = (("add_or_sub", ADD_SUB), ("add_or_sub", ADD_SUB), ("mul", MUL))  # two add/sub per product


@dataclass(frozen=True)
class Setup:
    """One study: what is trained, on which tokenizers, where its results go, and the data sizes."""

    name: str
    recipe: Path
    tokenizers: dict = field(default_factory=dict)  # name -> (style: digits | groups3 | BACKBONE, numeric policy)
    out: Path = REPO_ROOT / "docs" / "study"  # committed: results, per-run records, plots
    work: Path = REPO_ROOT / "runs" / "study"  # data, checkpoints, models
    train_examples: int = 20000
    eval_examples: int = 600
    max_new_tokens: int = 8
    backbone: str | None = None  # recipes.experiments.backbone name: fine-tune it (and evaluate it zero-shot)
    keep_models: bool = True  # False: keep the exported models of one seed only (the probe's), see run_one
    probe_rows: int = 300  # test rows the digit probe reads per model


SETUPS = {
    "tiny": Setup("tiny", REPO_ROOT / "recipes" / "configs" / "study.yaml",
                  {"digits": ("digits", "digits"), "groups3": ("groups3", "integers")}),
    # 1000 test problems: their draw adds about 3 points to a paired difference between two losses;
    # the seeds' spread adds more (see docs/study-smollm2/), which only more seeds would narrow.
    "smollm2": Setup("smollm2", REPO_ROOT / "recipes" / "configs" / "smollm2-study.yaml",
                     {"smollm2": (BACKBONE, "digits")}, out=REPO_ROOT / "docs" / "study-smollm2",
                     work=REPO_ROOT / "runs" / "study-smollm2", train_examples=5000, eval_examples=1000,
                     max_new_tokens=8, backbone="smollm2", keep_models=False, probe_rows=100),
}


def log(message: str) -> None:
    print(f"[study {time.strftime('%H:%M:%S')}] {message}", flush=True)


def write_problems(out: Path, n_train: int, n_eval: int, seed: int = 0, mix=MIX) -> tuple[Path, Path]:
    """Disjoint train / held-out JSONL from `mix` (default: two add/sub problems for each multiplication)."""
    return write_arithmetic_split(out, n_train, n_eval, list(mix), seed)


def backbone_dir(setup: Setup) -> Path | None:
    """The setup's backbone directory (made on first use by recipes.experiments.backbone), or None."""
    if setup.backbone is None:
        return None

    return get_backbone(setup.backbone)


def tokenizer_dir(setup: Setup, work: Path, tokenizer: str) -> Path:
    style = setup.tokenizers[tokenizer][0]
    return backbone_dir(setup) if style == BACKBONE else work / tokenizer / "tokenizer"


def build_data(setup: Setup, work: Path, n_train: int, n_eval: int, mix=MIX) -> None:
    train_jsonl, eval_jsonl = write_problems(work / "problems", n_train, n_eval, mix=mix)
    texts = [p.read_text() for p in (train_jsonl, eval_jsonl)]
    for name, (style, policy) in setup.tokenizers.items():
        root = work / name
        if (root / "data" / "eval" / "manifest.json").exists():
            continue
        if style != BACKBONE:
            train_tokenizer(texts, root / "tokenizer", style=style)
        for split, path in (("train", train_jsonl), ("eval", eval_jsonl)):
            totals = build_jsonl_shards(path, tokenizer_dir(setup, work, name), root / "data" / split,
                                        numeric_policy=policy)
            log(f"{name}/{split}: {totals['examples_kept']} examples, {totals['numeric_tokens']} numeric labels")


def eval_record(results: dict) -> dict:
    """What a run's record keeps of its evaluation: the metrics, which problems it solved (a string of
    0/1 in the eval set's row order, for the paired comparison), a fingerprint of those problems, every
    answer's text and its target (so closeness pairs by problem too) and the closeness over the numeric
    targets (`recipes.evaluation.metrics.closeness`, an unparsed answer at the targets' span)."""
    examples = results["examples"]
    ids = "\n".join(str(e["example_id"]) for e in examples)
    answers = [e["prediction"] for e in examples]
    targets = [e["target"] for e in examples]
    numeric = [(a, t) for a, t in zip(answers, targets) if t is not None]
    return {"metrics": results["metrics"],
            "correct": "".join("1" if e.get("correct") else "0" for e in examples),
            "eval_ids_sha256": hashlib.sha256(ids.encode()).hexdigest(),
            "answers": answers, "targets": targets,
            "closeness": closeness([a for a, _ in numeric], [t for _, t in numeric]) if numeric else None}


def speed(curve: list[dict]) -> float | None:
    """Median training tokens/s over the steps after the first (which pays for warm-up)."""
    rates = [r["tokens_per_s"] for r in curve[1:] if r.get("tokens_per_s")]
    return statistics.median(rates) if rates else None


def curve_row(row: dict) -> dict:
    """What a record keeps of one metrics.jsonl row: the losses, speed, the pre-clip gradient norm and,
    on diagnosed steps, every `grad/<part>/...` key (norm, share, cosine with CE, off-block bound) and
    whether the step was clipped. The norms stay because the off-block bound is read relative to them."""
    keep = {"step", "ce", "loss", "tokens_per_s", "grad_norm", "clipped"}
    return {k: v for k, v in row.items() if k in keep or k.startswith(("term/", "grad/"))}


def run_one(setup: Setup, work: Path, out: Path, tokenizer: str, loss: str, seed: int, steps: int | None,
            objective: dict | None = None, overrides: tuple[str, ...] = (), keep_model: bool | None = None) -> dict:
    """Train, evaluate and record one run; `objective` (default `LOSSES[loss]`) and `overrides` (recipe
    overrides after the study's own) let a regime of `recipes.experiments.regimes` vary the setting;
    `keep_model` (default: the setup's rule) whether the exported model stays."""

    name = f"{tokenizer}-{loss}-s{seed}"
    run_dir = work / "runs" / name
    policy = setup.tokenizers[tokenizer][1]
    model = (f"model.name_or_path={backbone_dir(setup)}" if setup.tokenizers[tokenizer][0] == BACKBONE
             else f"model.tokenizer={tokenizer_dir(setup, work, tokenizer)}")
    objective = LOSSES[loss] if objective is None else objective
    settings = [f"name={name}", f"train.out_dir={run_dir}", f"train.seed={seed}",
                f"loss.objective={json.dumps(objective)}", f"loss.numeric_policy={policy}",
                f"data.train={work / tokenizer / 'data' / 'train'}", model, *overrides]
    if steps is not None:
        settings.append(f"train.steps={steps}")
    seconds = run_recipe(setup.recipe, settings, nproc=2, quiet=True)
    results = evaluate(str(run_dir / "final"), str(work / tokenizer / "data" / "eval"), batch_size=100,
                       max_new_tokens=setup.max_new_tokens, name=name)
    curve = read_metrics_jsonl(str(run_dir / "metrics.jsonl"))
    record = {"name": name, "tokenizer": tokenizer, "loss": loss, "seed": seed, "train_seconds": round(seconds, 1),
              "objective": objective, "overrides": list(overrides),
              **eval_record(results), "tokens_per_s": speed(curve), "final": curve[-1],
              "curve": [curve_row(r) for r in curve]}
    path = out / "runs" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    # A 135M model's DeepSpeed checkpoint (weights + Adam state) is ~1.6 GB: the record is what stays.
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    if keep_model is None:
        keep_model = setup.keep_models or not any(s != seed for s in models_by_seed(work, tokenizer))
    if not keep_model:
        shutil.rmtree(run_dir / "final", ignore_errors=True)
    return record


def zero_shot(setup: Setup, work: Path, out: Path) -> None:
    """The backbone's own answers on each of its tokenizers' test problems, before any training (once;
    kept in `<out>/zero_shot-<tokenizer>.json`)."""

    for tokenizer, (style, _) in setup.tokenizers.items():
        path = out / f"zero_shot-{tokenizer}.json"
        if style == BACKBONE and not path.exists():
            results = evaluate(str(backbone_dir(setup)), str(work / tokenizer / "data" / "eval"), batch_size=100,
                               max_new_tokens=setup.max_new_tokens, name=f"{tokenizer}-zero-shot")
            path.write_text(json.dumps({"name": results["name"], "tokenizer": tokenizer, **eval_record(results)},
                                       indent=1) + "\n")


def log_errors(record: dict) -> list[float]:
    """log(1 + |error|) of each numeric-target answer of a record (unparsed at its closeness miss error)."""
    pairs = [(a, t) for a, t in zip(record["answers"], record["targets"]) if t is not None]
    rows = closeness_per_problem([a for a, _ in pairs], [t for _, t in pairs], record["closeness"]["miss_error"])
    return [r["log_error"] for r in rows]


def log_mae_versus_ce(group: list[dict], ce: list[dict]) -> dict | None:
    """log-MAE of this loss minus CE's, paired by seed and problem (`two_level_bootstrap` over each
    problem's log error), over the seeds both have run with per-problem answers; None without them."""
    by_seed = {r["seed"]: r for r in group if r.get("answers") is not None}
    ce_by_seed = {r["seed"]: r for r in ce if r.get("answers") is not None}
    seeds = sorted(by_seed.keys() & ce_by_seed.keys())
    if not seeds:
        return None
    if len({r["eval_ids_sha256"] for s in seeds for r in (by_seed[s], ce_by_seed[s])}) != 1:
        raise ValueError(f"{by_seed[seeds[0]]['name']}: its log-MAE comparison mixes test sets")
    return two_level_bootstrap([log_errors(by_seed[s]) for s in seeds], [log_errors(ce_by_seed[s]) for s in seeds])


def versus_ce(group: list[dict], ce: list[dict]) -> dict | None:
    """Exact match of this loss minus CE's over the seeds both have run, paired by seed (same data
    order, same initial weights) and by test problem: `recipes.evaluation.stats.two_level_bootstrap`
    where the records say which problems each run solved, else the per-seed differences of exact match
    with their seed-level t interval (`seed_differences`). Below 3 common seeds: no interval."""

    by_seed = {r["seed"]: r for r in group}
    ce_by_seed = {r["seed"]: r for r in ce}
    seeds = sorted(by_seed.keys() & ce_by_seed.keys())
    if not seeds:
        return None
    mine, theirs = [by_seed[s] for s in seeds], [ce_by_seed[s] for s in seeds]
    if not all("correct" in r for r in mine + theirs):  # older records: each run's exact match only
        return seed_differences([m["metrics"]["exact_match"] - c["metrics"]["exact_match"]
                                 for m, c in zip(mine, theirs)])
    if len({r["eval_ids_sha256"] for r in mine + theirs}) != 1:
        raise ValueError(f"{mine[0]['name']} and {theirs[0]['name']} were scored on different test problems")
    return two_level_bootstrap([[c == "1" for c in r["correct"]] for r in mine],
                               [[c == "1" for c in r["correct"]] for r in theirs])


def aggregate(records: list[dict], order=LOSSES) -> list[dict]:
    """Mean and standard deviation over seeds, per (tokenizer, loss), in `order`'s order of losses
    (tokenizers as they first appear), with the difference against CE (`versus_ce`) and the mean
    training speed."""
    rows = []
    for tokenizer in dict.fromkeys(r["tokenizer"] for r in records):
        ce = [r for r in records if r["tokenizer"] == tokenizer and r["loss"] == "ce"]
        for loss in order:
            group = [r for r in records if r["tokenizer"] == tokenizer and r["loss"] == loss]
            if not group:
                continue
            row = {"tokenizer": tokenizer, "loss": loss, "seeds": len(group)}
            for key in ("exact_match", "mae", "r2", "parse_rate"):
                values = [r["metrics"][key] for r in group if r["metrics"].get(key) is not None]
                row[key] = statistics.mean(values) if values else None
                row[key + "_sd"] = statistics.stdev(values) if len(values) > 1 else None
                row[key + "_n"] = len(values)  # MAE and R² exist only for seeds with parsed answers
            log_maes = [r["closeness"]["log_mae"] for r in group if r.get("closeness")]
            row["log_mae"] = statistics.mean(log_maes) if log_maes else None  # records from before closeness: none
            row["log_mae_sd"] = statistics.stdev(log_maes) if len(log_maes) > 1 else None
            row["log_mae_n"] = len(log_maes)
            row["final_ce"] = statistics.mean(r["final"]["ce"] for r in group)
            rates = [r.get("tokens_per_s") or r["final"].get("tokens_per_s") for r in group]
            row["tokens_per_s"] = statistics.mean(rates) if all(rates) else None
            row["vs_ce"] = versus_ce(group, ce) if loss != "ce" else None
            row["log_mae_vs_ce"] = log_mae_versus_ce(group, ce) if loss != "ce" else None
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

    def versus(row, key="vs_ce", scale=100.0) -> str:
        v = row.get(key)
        if not v:
            return "– | – | –"
        both, per_seed, seed_t = versus_cells(v, scale)
        if MIN_SEEDS <= v["n_seeds"] < row["seeds"]:
            both += f" ({v['n_seeds']} seeds)"
        return f"{both} | {per_seed} | {seed_t}"

    lines = [("Mean ± sample standard deviation over seeds; MAE and R² over parsed answers only. "
             "Δ vs CE: exact match minus CE's in points over the seeds both have run, paired by seed and "
             "test problem, with a 95% two-level bootstrap interval (resampling the seeds, then the test "
             "problems), which counts the run-to-run spread as well as the draw of test problems; "
             "Δ per seed: the difference at each seed; t over seeds: the 95% t interval of those, each seed "
             f"one observation. With fewer than {MIN_SEEDS} seeds in common with CE no ranking can be read "
             "and no interval is shown. A bootstrap over 3 seeds cannot reach past their extremes, so the "
             "t interval is the wider of the two: a difference can be read as the loss's where both "
             "exclude 0. log-MAE: mean log(1 + |ŷ − y|) over every answer, an unparsed one at the test targets' "
             "span (n/a for records made before the answers were kept); its Δ vs CE in nats ×100, with the same "
             "two intervals. tokens/s: training throughput (all ranks), mean over seeds of each run's median "
             "step."), "",
             ("| tokenizer | loss | seeds | exact match % | MAE | R² | parse rate % | log-MAE | final train CE"
              " | Δ exact match vs CE [95% seeds × problems] | Δ per seed | Δ 95% t over seeds"
              " | Δ log-MAE ×100 vs CE [95% seeds × problems] | Δ per seed | Δ 95% t over seeds | tokens/s |"),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        rate = f"{row['tokens_per_s']:.0f}" if row.get("tokens_per_s") else "–"
        lines.append(f"| {row['tokenizer']} | {row['loss']} | {row['seeds']} | {cell(row, 'exact_match', 100, 1)}"
                     f" | {cell(row, 'mae')} | {cell(row, 'r2', 1, 3)} | {cell(row, 'parse_rate', 100, 1)}"
                     f" | {cell(row, 'log_mae', 1, 3)} | {row['final_ce']:.3f} | {versus(row)}"
                     f" | {versus(row, 'log_mae_vs_ce')} | {rate} |")
    return "\n".join(lines)


def zero_shot_lines(found: dict) -> list[str]:
    if not found:
        return []
    lines = ["", "Before training (the backbone zero-shot, greedy, same test problems and prompts):", ""]
    for tokenizer, z in found.items():
        m = z["metrics"]
        mae = "n/a" if m.get("mae") is None else f"{m['mae']:.2f}"
        r2 = "n/a" if m.get("r2") is None else f"{m['r2']:.3f}"
        lines.append(f"- {tokenizer}: exact match {100 * m['exact_match']:.1f}% ({m['n']} problems), MAE {mae},"
                     f" R² {r2}, parse rate {100 * m['parse_rate']:.1f}%")
    return lines


def progress_lines(records: list[dict], grid: list[str]) -> list[str]:
    """Which runs of the planned grid are done and which are not (a partial study says so)."""
    done = {r["name"] for r in records}
    missing = [name for name in grid if name not in done]
    lines = ["", f"Runs done: {len(done & set(grid))} of {len(grid)} planned."]
    lines.append("Done: " + (", ".join(name for name in grid if name in done) or "none") + ".")
    if missing:
        lines.append("Missing (not run yet): " + ", ".join(missing) + ".")
    extra = sorted(done - set(grid))
    if extra:
        lines.append("Also present, outside the planned grid: " + ", ".join(extra) + ".")
    return lines


def plan(setup: Setup, seeds: int, losses: list[str], tokenizers: list[str],
         objectives: dict = LOSSES) -> list[tuple[str, str, int]]:
    """The (tokenizer, loss, seed) runs of a study, seed by seed (a partial study has whole seeds).
    `objectives`: each loss's objective (a recipe's loss.objective mapping). A loss whose terms need what a
    tokenizer's numeric policy cannot give (their registered needs: NTIL's and DEL's digits) is left out
    for that tokenizer (`recipes.checks.objective_checks.policy_problems`)."""
    space_variants = read_recipe_file(setup.recipe).get("loss", {}).get("space_variants", False)
    typed = {loss: ObjectiveConfig.from_dict(objectives[loss], root="loss.objective") for loss in losses}
    return [(t, loss, s) for s in range(seeds) for t in tokenizers for loss in losses
            if not policy_problems(typed[loss], setup.tokenizers[t][1], space_variants)]


def models_by_seed(work: Path, tokenizer: str) -> dict[int, dict[str, Path]]:
    """The trained models present in `work`, {seed: {loss: model dir}}, for one tokenizer. Records are
    committed but models stay on the machine that trained them, so which seeds have models varies."""
    found: dict[int, dict[str, Path]] = {}
    for model_dir in sorted((work / "runs").glob(f"{tokenizer}-*-s*/final")):
        name = model_dir.parent.name.removeprefix(f"{tokenizer}-")
        loss, _, seed = name.rpartition("-s")
        if loss in LOSSES and seed.isdigit() and (model_dir / "config.json").exists():
            found.setdefault(int(seed), {})[loss] = model_dir
    return found


def probe_models(work: Path, tokenizer: str) -> tuple[int | None, dict[str, Path]]:
    """The probe's models: all from one seed, the one with models for the most losses (the lowest of
    those), in the order of LOSSES."""
    found = models_by_seed(work, tokenizer)
    if not found:
        return None, {}
    seed = min(found, key=lambda s: (-len(found[s]), s))
    return seed, {loss: found[seed][loss] for loss in LOSSES if loss in found[seed]}


def report(setup: Setup, work: Path, out: Path, grid: list[str], probe: bool = True) -> str:
    """Tables, CSV, learning curves and the probe from the finished runs' records."""
    import csv


    records = [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]
    if not records:
        raise FileNotFoundError(f"{out / 'runs'}: no finished runs to report")
    rows = aggregate(records)
    found = {p.stem.removeprefix("zero_shot-"): json.loads(p.read_text()) for p in sorted(out.glob("zero_shot-*.json"))}
    table = "\n".join([markdown(rows), *zero_shot_lines(found), *progress_lines(records, grid)])
    (out / "results.md").write_text(table + "\n")
    with open(out / "results.csv", "w", newline="") as f:
        flat = [{k: (json.dumps(v) if isinstance(v, dict) else v) for k, v in row.items()} for row in rows]
        writer = csv.DictWriter(f, fieldnames=list(flat[0]))
        writer.writeheader()
        writer.writerows(flat)
    for tokenizer in setup.tokenizers:
        curves = {r["loss"]: r["curve"] for r in records if r["tokenizer"] == tokenizer and r["seed"] == 0}
        if curves:
            plot_curves(curves, str(out / f"curves-{tokenizer}.png"), keys=["ce"])
        if probe:
            probes = {}
            eval_dir = work / tokenizer / "data" / "eval"
            if tokenizer in found and eval_dir.exists():  # the backbone before training, as the first panel
                probes["zero-shot"] = probe_model(str(backbone_dir(setup)), str(eval_dir), limit=setup.probe_rows)
            seed, models = probe_models(work, tokenizer)
            for loss, model_dir in models.items():
                probes[f"{loss} (seed {seed})"] = probe_model(str(model_dir), str(eval_dir), limit=setup.probe_rows)
            if probes:
                plot_probe(probes, str(out / f"probe-{tokenizer}.png"))
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.study", description=__doc__.split("\n")[0])
    parser.add_argument("--setup", choices=sorted(SETUPS), default="tiny")
    parser.add_argument("--out", default=None, help="results, committed (default: the setup's docs/ folder)")
    parser.add_argument("--work", default=None, help="data, checkpoints, models (default: the setup's runs/ folder)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None, help="override train.steps of the study recipe")
    parser.add_argument("--train-examples", type=int, default=None)
    parser.add_argument("--eval-examples", type=int, default=None)
    parser.add_argument("--losses", default=",".join(LOSSES), help="comma-separated subset")
    parser.add_argument("--tokenizers", default=None, help="comma-separated subset of the setup's")
    parser.add_argument("--budget-min", type=float, default=None,
                        help="start no new run after this many minutes (the study resumes later)")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--no-probe", action="store_true", help="leave the probe plots as they are (fast)")
    args = parser.parse_args(argv)
    setup = SETUPS[args.setup]
    work, out = Path(args.work or setup.work), Path(args.out or setup.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizers = args.tokenizers.split(",") if args.tokenizers else list(setup.tokenizers)
    unknown = sorted(set(tokenizers) - set(setup.tokenizers)) + sorted(set(args.losses.split(",")) - set(LOSSES))
    if unknown:
        raise SystemExit(f"unknown tokenizer or loss {unknown[0]!r} for setup {setup.name!r}")
    grid = plan(setup, args.seeds, args.losses.split(","), tokenizers)

    if not args.report_only:
        build_data(setup, work, args.train_examples or setup.train_examples, args.eval_examples or setup.eval_examples)
        zero_shot(setup, work, out)
        started = time.time()
        for i, (tokenizer, loss, seed) in enumerate(grid, 1):
            if (out / "runs" / f"{tokenizer}-{loss}-s{seed}.json").exists():
                continue
            if args.budget_min is not None and time.time() - started > 60 * args.budget_min:
                log(f"{args.budget_min:g} min spent: stopping before {tokenizer}-{loss}-s{seed}")
                break
            record = run_one(setup, work, out, tokenizer, loss, seed, args.steps)
            elapsed = time.time() - started
            m = record["metrics"]
            log(f"{i}/{len(grid)} {record['name']}: exact match {m['exact_match']}, MAE {m['mae']},"
                f" parse rate {m['parse_rate']} ({record['train_seconds']:.0f} s; {elapsed / 60:.1f} min so far)")
    print(report(setup, work, out, [f"{t}-{loss}-s{s}" for t, loss, s in grid], probe=not args.no_probe))
    return 0


if __name__ == "__main__":
    sys.exit(main())
