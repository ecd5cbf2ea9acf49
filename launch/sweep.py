"""Scaling-study sweeps: a grid of recipes (backbones x losses x seeds) as separate jobs, one results table.

    python -m launch.sweep SWEEP.yaml [--address HEAD:6379] [--only NAME ...] [--collect]

SWEEP.yaml:

    name: scaling
    base: ../recipes/configs/llama3-8b-gsm8k/ce.yaml   # relative to this file
    out_dir: runs/scaling                              # job J trains in <out_dir>/<J>
    overrides: [train.steps=2000]                      # for every job
    backbones:                                         # name -> overrides
      llama3-8b: [model.name_or_path=meta-llama/Meta-Llama-3-8B]
      llama3-70b: [model.name_or_path=meta-llama/Meta-Llama-3-70B, cluster.nodes=8]
    losses:
      ce: ["loss.objective={terms: {}}"]
      smmd: ["loss.objective={terms: {smmd: {}}}"]
    seeds: [0, 1, 2]                                   # -> train.seed=S
    launcher: ray            # ray: each job a Ray Train run (launch.ray.run) | torchrun: local subprocess
    max_failures: 1
    num_workers: null        # default: what each recipe's cluster section implies
    evaluate: true           # recipes.evaluation.evaluate on the job's final/ model (eval.data or data.eval)
    baseline: ce             # the loss every other loss is compared with, backbone by backbone

Job J = `<backbone>-<loss>-s<seed>`, trained with overrides base < sweep `overrides` < backbone < loss <
`train.seed=S`, `train.out_dir=<out_dir>/J`, `name=J`. Jobs run one after another (each takes the whole
allocation); a finished job (its last checkpoint at `train.steps` and, when it exports, a `final/` that
records that checkpoint: `recipes.reliability.resume_policy.run_finished`) is skipped when the sweep is run
again, with its evaluation if it has one; an interrupted one resumes from its own checkpoints, and one whose
`final/` is missing or holds an earlier step is started again (its start exports the last checkpoint) and
evaluated again. `--collect` only rebuilds the table.
Before the first job trains, every job's recipe is loaded as its run will load it (`job_recipes`): a loss
whose objective or `loss.plugins` cannot load stops the sweep there (exit 2) naming the job. A loss of the
user's own is a loss like the others: `mine: ["loss.plugins=[mypkg.terms]", "loss.objective={terms: {my_term: {}}}"]`.

Results: `<out_dir>/results.csv` and `results.md`: one row per job (backbone, loss, seed, steps, final
training loss/ce and every evaluation metric), then a Markdown table of mean ± std over seeds per
(backbone, loss), then each loss's exact match against the `baseline` loss of the same backbone:
the difference in points over the seeds both have, with a two-level bootstrap interval (seeds, then
test problems; `recipes.evaluation.stats.two_level_bootstrap`), the per-seed differences and their t
interval. Seeds of one loss differ about as much as two losses do, so with fewer than 3 seeds the
table says that no ranking can be read and shows no interval. Evaluation uses
`recipes.evaluation.evaluate.evaluate`; without eval data (or with `evaluate: false`) the table has the
final training metrics only. `EVALUATE` is the hook to replace.
"""

from __future__ import annotations

import argparse
import csv
import io
import itertools
import json
import math
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from recipes.config import load_recipe
from recipes.evaluation.evaluate import evaluate
from recipes.evaluation.placement import local_gpus, plan_placement
from recipes.evaluation.stats import MIN_SEEDS, seed_differences, two_level_bootstrap, versus_cells
from recipes.reliability.resume_policy import run_finished

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}")
SWEEP_KEYS = {"name", "base", "out_dir", "overrides", "backbones", "losses", "seeds", "launcher",
              "max_failures", "num_workers", "evaluate", "eval_limit", "baseline"}


@dataclass
class Job:
    name: str
    backbone: str
    loss: str
    seed: int
    overrides: list[str]
    out_dir: Path


@dataclass
class Sweep:
    name: str
    base: Path
    out_dir: Path
    jobs: list[Job] = field(default_factory=list)
    launcher: str = "ray"
    max_failures: int = 0
    num_workers: int | None = None
    evaluate: bool = True
    eval_limit: int | None = None
    baseline: str = "ce"


def load_sweep(path: str | Path) -> Sweep:
    path = Path(path)
    spec = yaml.safe_load(path.read_text()) or {}
    unknown = sorted(set(spec) - SWEEP_KEYS)
    if unknown:
        raise ValueError(f"sweep {path}: unknown key {unknown[0]} (known: {sorted(SWEEP_KEYS)})")
    for key in ("base", "backbones", "losses"):
        if key not in spec:
            raise ValueError(f"sweep {path}: {key} is required")
    if spec.get("launcher", "ray") not in ("ray", "torchrun"):
        raise ValueError(f"sweep {path}: launcher {spec['launcher']!r} is not ray or torchrun")

    def named(key: str) -> dict[str, list[str]]:
        table = spec[key]
        if not isinstance(table, dict) or not table:
            raise ValueError(f"sweep {path}: {key} must map names to override lists")
        for name, overrides in table.items():
            if not _NAME.fullmatch(str(name)):
                raise ValueError(f"sweep {path}: {key} name {name!r} is not a valid job name part")
            if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
                raise ValueError(f"sweep {path}: {key}.{name} must be a list of key=value strings")
        return {str(k): list(v) for k, v in table.items()}

    here = path.resolve().parent
    base = (here / spec["base"]).resolve()
    out_dir = Path(spec.get("out_dir", f"runs/{spec.get('name', path.stem)}"))
    out_dir = out_dir if out_dir.is_absolute() else (Path.cwd() / out_dir)
    seeds = spec.get("seeds", [0])
    if not all(isinstance(s, int) for s in seeds):
        raise ValueError(f"sweep {path}: seeds must be integers")
    common = list(spec.get("overrides", []))
    sweep = Sweep(name=str(spec.get("name", path.stem)), base=base, out_dir=out_dir,
                  launcher=spec.get("launcher", "ray"), max_failures=int(spec.get("max_failures", 0)),
                  num_workers=spec.get("num_workers"), evaluate=bool(spec.get("evaluate", True)),
                  eval_limit=spec.get("eval_limit"), baseline=str(spec.get("baseline", "ce")))
    for (bname, bover), (lname, lover), seed in itertools.product(named("backbones").items(),
                                                                  named("losses").items(), seeds):
        name = f"{bname}-{lname}-s{seed}"
        job_out = out_dir / name
        sweep.jobs.append(Job(name, bname, lname, seed,
                              [*common, *bover, *lover, f"train.seed={seed}", f"train.out_dir={job_out}",
                               f"name={name}"], job_out))
    return sweep


# ---- running ------------------------------------------------------------------------------------------


def run_job(sweep: Sweep, job: Job, address: str | None = None) -> None:
    if sweep.launcher == "ray":
        from launch.ray import run

        run(sweep.base, job.overrides, address=address, max_failures=sweep.max_failures,
            num_workers=sweep.num_workers, name=job.name)
    else:  # torchrun on this machine

        cluster = load_recipe(sweep.base, job.overrides).cluster
        nproc = str(sweep.num_workers or cluster.nodes * cluster.ranks_per_node())
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", nproc,
               "-m", "recipes.train", str(sweep.base), *job.overrides]
        subprocess.run(cmd, check=True)


def evaluate_job(sweep: Sweep, job: Job) -> dict | None:
    """recipes.evaluation.evaluate on the job's exported model; None when there is nothing to evaluate."""

    recipe = load_recipe(job.out_dir / "recipe.yaml") if (job.out_dir / "recipe.yaml").is_file() else None
    if recipe is None or not (job.out_dir / "final").is_dir():
        return None
    data = recipe.eval.data or recipe.data.eval
    if not data:
        return None
    final = job.out_dir / "final"
    # the export's placement on this node's GPUs (a 70B export spans several: vLLM tensor parallelism or
    # device_map auto), refused before loading where this node cannot hold it
    gpus, gpu_bytes = local_gpus()
    if recipe.cluster.gpus_per_node and not gpus:
        print(f"[launch.sweep] {job.name}: not evaluated: the recipe trains on GPUs and this node has none; "
              "rerun the sweep on a GPU node to evaluate", flush=True)
        return None
    placement = plan_placement(final, gpus, gpu_bytes)
    limit = sweep.eval_limit if sweep.eval_limit is not None else recipe.eval.limit
    return evaluate(str(final), data, out=str(job.out_dir / "eval_results.json"),
                    batch_size=recipe.eval.batch_size, max_new_tokens=recipe.eval.max_new_tokens,
                    answer_format=recipe.eval.answer_format, limit=limit, name=job.name,
                    backend=recipe.eval.backend, eval_section=recipe.eval, placement=placement)


EVALUATE = evaluate_job  # the hook: f(sweep, job) -> results dict with "metrics", or None


def job_recipes(sweep: Sweep, only: list[str] | None = None) -> dict:
    """{job name: its recipe} for every job (of `only`), each loaded as its run will load it (base and
    overrides, its loss.plugins imported): a job whose recipe cannot load is a ValueError naming the job,
    before any job trains."""
    recipes = {}
    for job in sweep.jobs:
        if only and job.name not in only:
            continue
        try:
            recipes[job.name] = load_recipe(sweep.base, job.overrides)
        except (ValueError, FileNotFoundError) as err:
            raise ValueError(f"sweep {sweep.name}: job {job.name} ({job.backbone} x {job.loss}): {err}") from None
    return recipes


def run_sweep(sweep: Sweep, address: str | None = None, only: list[str] | None = None) -> list[dict]:

    recipes = job_recipes(sweep, only)  # every job's recipe loads before the first trains
    sweep.out_dir.mkdir(parents=True, exist_ok=True)
    for job in sweep.jobs:
        if only and job.name not in only:
            continue
        # the resume policy's rule: its last checkpoint at train.steps and, when it exports, final/ holding
        # that checkpoint (an export cut short leaves an earlier model there: the job's own start exports it)
        ran = not run_finished(recipes[job.name], job.out_dir)
        if ran:
            print(f"[launch.sweep] {job.name}: training in {job.out_dir}", flush=True)
            run_job(sweep, job, address)
        else:
            print(f"[launch.sweep] {job.name}: done already", flush=True)
        if sweep.evaluate and (ran or not (job.out_dir / "eval_results.json").is_file()):
            EVALUATE(sweep, job)  # a job that ran again has a new final/: an earlier evaluation is of another model
    return collect(sweep)


# ---- the table ----------------------------------------------------------------------------------------


def job_row(job: Job) -> dict:
    row: dict = {"job": job.name, "backbone": job.backbone, "loss": job.loss, "seed": job.seed}
    metrics = job.out_dir / "metrics.jsonl"
    rows = [json.loads(l) for l in metrics.read_text().splitlines() if l.strip()] if metrics.is_file() else []
    if rows:
        last = rows[-1]
        row.update({"steps": last["step"], "train_loss": last.get("loss"), "train_ce": last.get("ce")})
    results = job.out_dir / "eval_results.json"
    if results.is_file():
        for key, value in json.loads(results.read_text()).get("metrics", {}).items():
            row[f"eval_{key}"] = value
    return row


def collect(sweep: Sweep) -> list[dict]:
    """Write results.csv and results.md in the sweep's out_dir; returns the rows."""
    rows = [job_row(job) for job in sweep.jobs]
    columns = ["job", "backbone", "loss", "seed", "steps", "train_loss", "train_ce"]
    columns += sorted({k for r in rows for k in r} - set(columns))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: r.get(k, "") for k in columns})
    (sweep.out_dir / "results.csv").write_text(buf.getvalue())
    (sweep.out_dir / "results.md").write_text(markdown(sweep, rows, columns))
    return rows


def _fmt(value) -> str:
    if value is None or value == "" or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|")


def outcomes(job: Job) -> dict | None:
    """{example_id: 1.0 or 0.0} for the problems the job's evaluation scored by exact match, or None
    without an evaluation that lists its examples."""
    results = job.out_dir / "eval_results.json"
    if not results.is_file():
        return None
    examples = json.loads(results.read_text()).get("examples") or []
    scored = {e["example_id"]: float(bool(e["correct"])) for e in examples if "correct" in e}
    return scored or None


def versus_baseline(sweep: Sweep, rows: list[dict]) -> list[tuple[str, str, dict | str]]:
    """(backbone, loss, comparison) for every loss but the baseline, on each backbone that has the
    baseline: exact match minus the baseline's over the seeds both have evaluated, paired by seed and
    problem (`two_level_bootstrap`); from each seed's exact match alone (`seed_differences`) where the
    evaluations list no examples; a string saying why where nothing can be compared."""

    jobs = {(j.backbone, j.loss, j.seed): j for j in sweep.jobs}
    em = {(r["backbone"], r["loss"], r["seed"]): r.get("eval_exact_match") for r in rows}
    out: list[tuple[str, str, dict | str]] = []
    for backbone, loss in dict.fromkeys((j.backbone, j.loss) for j in sweep.jobs):
        if loss == sweep.baseline or (backbone, sweep.baseline) not in {(j.backbone, j.loss) for j in sweep.jobs}:
            continue
        seeds = sorted(s for (b, l, s), v in em.items() if b == backbone and l == loss and v is not None
                       and em.get((backbone, sweep.baseline, s)) is not None)
        if not seeds:
            out.append((backbone, loss, "no seed evaluated for both"))
            continue
        mine = [outcomes(jobs[backbone, loss, s]) for s in seeds]
        theirs = [outcomes(jobs[backbone, sweep.baseline, s]) for s in seeds]
        if any(o is None for o in mine + theirs):
            out.append((backbone, loss, seed_differences(
                [em[backbone, loss, s] - em[backbone, sweep.baseline, s] for s in seeds])))
        elif len({frozenset(o) for o in mine + theirs}) != 1:
            out.append((backbone, loss, f"scored on different problems than {sweep.baseline}"))
        else:
            ids = list(mine[0])
            out.append((backbone, loss, two_level_bootstrap([[o[i] for i in ids] for o in mine],
                                                            [[o[i] for i in ids] for o in theirs])))
    return out


def markdown(sweep: Sweep, rows: list[dict], columns: list[str]) -> str:

    lines = [f"# Sweep {sweep.name}", "", "| " + " | ".join(columns) + " |",
             "|" + "|".join("---" if c in ("job", "backbone", "loss") else "---:" for c in columns) + "|"]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |" for r in rows]
    numeric = [c for c in columns if c not in ("job", "backbone", "loss", "seed", "steps")
               and not re.search(r"(^|_)n(_numeric)?$", c)  # counts are not averaged
               and any(isinstance(r.get(c), (int, float)) and not isinstance(r.get(c), bool) for r in rows)]
    lines += ["", "Mean ± std over seeds:", "",
              "| backbone | loss | seeds | " + " | ".join(numeric) + " |",
              "|---|---|---:|" + "|".join("---:" for _ in numeric) + "|"]
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["backbone"], r["loss"]), []).append(r)
    for (backbone, loss), group in groups.items():
        cells = []
        for c in numeric:
            values = [float(r[c]) for r in group if isinstance(r.get(c), (int, float)) and math.isfinite(float(r[c]))]
            if not values:
                cells.append("–")
                continue
            mean = sum(values) / len(values)
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
            cells.append(f"{mean:.4g} ± {std:.2g}")
        lines.append(f"| {backbone} | {loss} | {len(group)} | " + " | ".join(cells) + " |")
    versus = versus_baseline(sweep, rows)
    if versus:
        lines += ["", (f"Exact match minus {sweep.baseline}'s of the same backbone, in points, over the seeds "
                       "both have, paired by seed and test problem: a 95% two-level bootstrap interval (seeds, "
                       "then problems), the difference at each seed and the 95% t interval of those. With fewer "
                       f"than {MIN_SEEDS} seeds no ranking can be read and no interval is shown; a difference "
                       "is the loss's where both intervals exclude 0."), "",
                  (f"| backbone | loss | seeds | Δ exact match vs {sweep.baseline} [95% seeds × problems]"
                   " | Δ per seed | Δ 95% t over seeds |"), "|---|---|---:|---:|---:|---:|"]
        for backbone, loss, v in versus:
            if isinstance(v, str):
                lines.append(f"| {backbone} | {loss} | – | {v} | – | – |")
            else:
                lines.append(f"| {backbone} | {loss} | {v['n_seeds']} | " + " | ".join(versus_cells(v)) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.sweep", description=__doc__.split("\n")[0])
    p.add_argument("sweep")
    p.add_argument("--address", default=None, help="a running Ray cluster (default: a local instance)")
    p.add_argument("--only", nargs="*", default=None, help="run only these jobs (names)")
    p.add_argument("--collect", action="store_true", help="only rebuild results.csv / results.md")
    p.add_argument("--list", action="store_true", help="print the jobs and their overrides")
    args = p.parse_args(argv)
    sweep = load_sweep(args.sweep)
    if args.list:
        for job in sweep.jobs:
            print(job.name, " ".join(job.overrides))
        return 0
    if not args.collect:
        try:
            job_recipes(sweep, args.only)
        except ValueError as err:
            print(f"launch.sweep: {err}", file=sys.stderr)
            return 2
        run_sweep(sweep, args.address, args.only)
    else:
        collect(sweep)
    print((sweep.out_dir / "results.md").read_text())
    print(f"wrote {sweep.out_dir / 'results.csv'} and {sweep.out_dir / 'results.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
