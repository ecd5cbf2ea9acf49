"""The regime study: in which setting does a numeric term pay off on SmolLM2-135M-Instruct, and at what
weight? Four questions, a control and its follow-up, each a small grid of runs on the SmolLM2 study's
setup (`recipes.experiments.study`, docs/study-smollm2/), run in this order and published one by one:

    python -m recipes.regimes --regime weight [--seeds 3] [--budget-min M] [--report-only]

1. weight: SMMD at 0.3 / 1 / 3 and DIST2 at 0.1 / 0.3 / 1 (each spanning 10x around its default), CE
   alongside, everything else the base study's. CE, SMMD 3 and DIST2 0.1 ARE the base study's runs
   (same recipe, data, seeds): their records are read from docs/study-smollm2/runs/, not rerun.
2. length: 4x the steps (240, 3,840 problems, none seen twice) at half the peak LR (1e-4): does a gap
   open once the answer format is learnt?
3. data: 320 training problems seen 3 times (60 steps), the setting where the DIST2 paper reports its
   largest gains.
4. task: signed arithmetic (data_prep's DeepMind-Math-style generator: "add_or_sub" with negatives and
   one decimal, "mul" of signed integers): answers like "-12.7" or "-918" whose digits are all numeric
   labels, the sign and point plain CE.
5. control: CE alone at 0.4x the peak LR, beside the base study's CE and SMMD 3 (its runs): SMMD 3
   leaves CE 0.39 of the numeric-logit gradient, so this is CE starved of the update as much as that
   share could starve it. Where SMMD 3 is worse than this run too, starvation does not explain it.
6. lr: question 1's best weights at 0.4x the peak LR, where the control found CE better, against CE at
   that lr (the control's ce_lr0.4 runs, read from there).

Questions 2-4 compare CE with the best-weighted SMMD and DIST2 of question 1 (highest mean exact match
over its seeds); the choice is made when such a regime first starts, from question 1's records, and
written to `<out>/choice.json`, so that a later invocation continues the same grid. A regime whose
choice question 1 cannot yet make (fewer than 3 seeds for a weight) is refused.

Each run is a record in `docs/study-smollm2/regimes/<regime>/runs/` (skipped when present: the study
resumes by run); each invocation rewrites that regime's `results.md` (the base study's exact-match table,
with two-level intervals against CE, and the gradient table of `gradient_rows`), `results.csv` and
`curves.png` from whatever records exist, and lists the runs still missing.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from recipes.evaluation.report import SHARES, plot_curves
from recipes.evaluation.stats import MIN_SEEDS, seeds_to_exclude_zero
from recipes.experiments.study import (
    ADD_SUB,
    LOSSES,
    MIX,
    MUL,
    SETUPS,
    aggregate,
    build_data,
    log,
    markdown,
    progress_lines,
    run_one,
    write_problems,
    zero_shot,
    zero_shot_lines,
)

BASE = SETUPS["smollm2"]
OUT = BASE.out / "regimes"
FAMILIES = {"smmd": (0.3, 1.0, 3.0), "dist2": (0.1, 0.3, 1.0)}  # the middle of each is not its default:
# SMMD's default (3) is the top of its span and DIST2's (0.1) the bottom, so each span is 10x with the
# default at one end, toward the side the base study did not try.
DEFAULT_WEIGHT = {"smmd": 3.0, "dist2": 0.1}
DEFAULT_SEEDS = 3  # every question's grid; more seeds for one comparison: --seeds N --losses ce,<loss>
CONTROL = {"numeric_smoothing": LOSSES["numeric_smoothing"]}
BASE_LR = 2.0e-4  # the base study's peak lr (recipes/configs/smollm2-demo.yaml; a test keeps them equal)


def label(family: str, weight: float) -> str:
    return f"{family}_w{weight:g}"


def objective(family: str, weight: float) -> dict:
    return {"terms": {family: {"weight": weight}}}


@dataclass(frozen=True)
class Regime:
    """One question: its runs' settings beyond the base study's, and which losses it compares."""

    name: str
    question: str
    overrides: tuple[str, ...] = ()
    train_examples: int = BASE.train_examples
    mix: tuple = MIX
    weights: bool = False  # True: every weight of FAMILIES; False: CE and question 1's best weights
    # A fixed grid instead: (label, objective, overrides of that run alone) beside CE
    runs: tuple[tuple[str, dict, tuple[str, ...]], ...] = ()
    shares_base: bool = False  # the base study's runs at this exact setting are this regime's too
    # (regime, label): CE at this regime's setting is that regime's run under that label (same recipe,
    # data, order and initial weights), read from there, not trained again
    ce_from: tuple[str, str] | None = None
    work: Path = field(default=BASE.work)

    @property
    def out(self) -> Path:
        return OUT / self.name

    @property
    def base_test_set(self) -> bool:
        """Its data is the base study's (same folder), so are its test problems and zero-shot score."""
        return self.shares_base or self.work == BASE.work


SIGNED_DECIMAL = {**ADD_SUB, "negatives": True, "decimals": 1}
REGIMES = {r.name: r for r in (
    Regime("weight", "At which weight does SMMD or DIST2 help, against CE?", weights=True, shares_base=True),
    Regime("length", "Does a gap open past the format-learning phase (4x steps, half the LR, no repeats)?",
           overrides=("train.steps=240", "optim.lr=1.0e-4", "optim.warmup_steps=10", "train.save_every=40"),
           work=BASE.work.with_name("study-smollm2-length")),
    Regime("data", "With 320 training problems seen 3 times, does a term help?", train_examples=320,
           work=BASE.work.with_name("study-smollm2-data")),
    Regime("task", "On signed one-decimal arithmetic, does a term help?",
           mix=(("add_or_sub", SIGNED_DECIMAL), ("add_or_sub", SIGNED_DECIMAL), ("mul", {**MUL, "negatives": True})),
           work=BASE.work.with_name("study-smollm2-task")),
    # SMMD 3 leaves CE 0.39 of the numeric-logit gradient (the replay's share 0.61): CE alone at 0.4x the
    # lr is CE starved as much as that share could starve it. Base-study setting, so CE and SMMD 3 are
    # its runs.
    Regime("control", "Is SMMD 3's result CE getting less of the update? CE alone at 0.4x the lr",
           shares_base=True, runs=(("ce_lr0.4", {"terms": {}}, (f"optim.lr={0.4 * BASE_LR:.1e}",)),
                                   (label("smmd", 3.0), objective("smmd", 3.0), ()))),
    # The control found CE better at 0.4x the lr (+4.3 points over 4 seeds): a term against CE at the lr
    # that suits CE. CE there is the control's ce_lr0.4; the terms are question 1's best weights.
    Regime("lr", "At CE's better lr (0.4x), does a term help?", overrides=(f"optim.lr={0.4 * BASE_LR:.1e}",),
           ce_from=("control", "ce_lr0.4")),
)}


def read_records(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))] if folder.exists() else []


def base_records() -> list[dict]:
    """The base study's CE and default-weight SMMD / DIST2 runs, relabelled as the weight regime's."""
    names = {"ce": "ce", **{family: label(family, w) for family, w in DEFAULT_WEIGHT.items()}}
    return [{**r, "loss": names[r["loss"]], "name": f"{r['tokenizer']}-{names[r['loss']]}-s{r['seed']}",
             "objective": {"terms": {} if r["loss"] == "ce" else {r["loss"]: {"weight": DEFAULT_WEIGHT[r["loss"]]}}},
             "shared_from": f"docs/study-smollm2/runs/{r['name']}.json"}
            for r in read_records(BASE.out / "runs") if r["loss"] in names]


def records(regime: Regime) -> list[dict]:
    """A regime's finished runs: its own, and at the base study's setting the base study's and the CE runs
    that another regime at that setting made (CE at a seed is one run whichever question asked for it:
    same recipe, data, order and initial weights), read where they were recorded, not trained again."""
    found = read_records(regime.out / "runs")
    if regime.ce_from:
        other, as_label = regime.ce_from
        names = {r["name"] for r in found}
        for r in read_records(REGIMES[other].out / "runs"):
            name = r["name"].replace(f"-{as_label}-s", "-ce-s")
            if r["loss"] == as_label and name not in names:
                found.append({**r, "loss": "ce", "name": name, "shared_from": f"{other}/runs/{r['name']}.json"})
    if not regime.shares_base:
        return found
    found += base_records()
    names = {r["name"] for r in found}
    for other in REGIMES.values():
        if other.name == regime.name or not other.shares_base:
            continue
        for r in read_records(other.out / "runs"):
            if r["loss"] == "ce" and r["name"] not in names:
                names.add(r["name"])
                found.append({**r, "shared_from": f"{other.name}/runs/{r['name']}.json"})
    return found


def best_weights(min_seeds: int = 3) -> dict[str, float]:
    """{family: the weight with the highest mean exact match} over the weight regime's records; each
    weight needs `min_seeds` seeds, else ValueError (no best can be read from fewer)."""
    found = records(REGIMES["weight"])
    best = {}
    for family, weights in FAMILIES.items():
        means = {}
        for w in weights:
            scores = [r["metrics"]["exact_match"] for r in found if r["loss"] == label(family, w)]
            if len(scores) < min_seeds:
                raise ValueError(f"the weight regime has {len(scores)} seed(s) of {label(family, w)}; "
                                 f"run `python -m recipes.regimes --regime weight` to {min_seeds} seeds first")
            means[w] = statistics.mean(scores)
        best[family] = max(means, key=means.get)
    return best


def losses(regime: Regime) -> dict[str, dict]:
    """{label: objective} of the regime, CE and the soft-target control first; a regime after the first
    reads (once) or makes its `choice.json`."""
    grid = {"ce": {"terms": {}}, **CONTROL}  # the soft-target control beside CE in every question
    if regime.runs:
        return grid | {name: goal for name, goal, _ in regime.runs}
    if regime.weights:
        for family, weights in FAMILIES.items():
            grid.update({label(family, w): objective(family, w) for w in weights})
        return grid
    path = regime.out / "choice.json"
    if path.exists():
        choice = json.loads(path.read_text())["best_weights"]
    else:
        choice = best_weights()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"best_weights": choice, "chosen": time.strftime("%Y-%m-%d %H:%M"),
                                    "from": "the weight regime's highest mean exact match"}, indent=1) + "\n")
    grid.update({label(family, w): objective(family, w) for family, w in choice.items()})
    return grid


def run_overrides(regime: Regime, loss: str) -> tuple[str, ...]:
    """The recipe overrides of one loss of a fixed grid (`Regime.runs`), after the regime's own."""
    return next((extra for name, _, extra in regime.runs if name == loss), ())


def mean_of(rows: list[dict], key: str) -> float | None:
    return mean_known(r.get(key) for r in rows)


def mean_known(values) -> float | None:
    """The mean of the values that are not None; None when there are none."""
    known = [v for v in values if v is not None]
    return statistics.mean(known) if known else None


def _off_block_ratio(steps: list[dict], part: str) -> float | None:
    """Mean over `steps` of `grad/<part>/off_block_max / grad/<part>/norm`: how large, at most, the part's
    gradient on the other columns of the numeric rows is against its block (None before the bound was
    logged, on 2026-12-03, or where the block's norm is 0)."""
    return mean_known(s[f"grad/{part}/off_block_max"] / s[f"grad/{part}/norm"] for s in steps
                      if s.get(f"grad/{part}/off_block_max") is not None and s.get(f"grad/{part}/norm"))


def _turn_from_ce(step: dict, term: str) -> float | None:
    """The angle in degrees between CE's gradient on the numeric logits and CE's + the term's, from the
    step's shares (their ratio is the norms') and the term's cosine with CE: how far the term turns the
    update's direction. Its cosine is the fraction of the sum's length along CE's direction: were the
    update the sum's direction at a fixed length, CE's direction would get cos(turn) of it, at the
    numeric logits (AdamW's normalisation acts on the parameters, where the angle is not measured)."""
    ce, share, cos = step.get("grad/ce/share"), step.get(f"grad/{term}/share"), step.get(f"grad/{term}/cos_ce")
    if not ce or share is None or cos is None:
        return None
    ratio = share / ce
    return math.degrees(math.atan2(ratio * math.sqrt(max(0.0, 1 - cos * cos)), 1 + ratio * cos))


def gradient_rows(found: list[dict], order: list[str]) -> list[dict]:
    """Per loss, over its runs (mean of each run's mean over its diagnosed steps): the term's share of
    the gradient on the numeric logits, its cosine with CE's, the angle it turns CE's gradient by
    (`_turn_from_ce`), the bound on CE's and the term's gradient off the numeric columns against their
    block (`numloss.diagnostics`), the share of steps clipped, and the median pre-clip gradient norm.
    Records made before a diagnostic existed have none (None)."""
    rows = []
    for loss in order:
        group = [r for r in found if r["loss"] == loss]
        if not group:
            continue
        terms = list(next(r for r in group)["objective"]["terms"])
        per_run = []
        for r in group:
            steps = [s for s in r["curve"] if "clipped" in s]
            per_run.append({"share": mean_known(sum(s.get(f"grad/{t}/share") or 0 for t in terms) for s in steps)
                            if steps and terms else None,
                            "cos_ce": mean_known(s.get(f"grad/{terms[0]}/cos_ce") for s in steps)
                            if steps and terms else None,
                            "turn": mean_known(_turn_from_ce(s, terms[0]) for s in steps)
                            if steps and terms else None,
                            "ce_off": _off_block_ratio(steps, "ce"),
                            "term_off": _off_block_ratio(steps, terms[0]) if terms else None,
                            "clipped": mean_of(steps, "clipped") if steps else None,
                            "grad_norm": statistics.median(s["grad_norm"] for s in r["curve"] if s.get("grad_norm"))
                            if any(s.get("grad_norm") for s in r["curve"]) else None})
        rows.append({"loss": loss, "runs": len(group), "diagnosed": sum(p["clipped"] is not None for p in per_run),
                     **{k: mean_of(per_run, k)
                        for k in ("share", "cos_ce", "turn", "ce_off", "term_off", "clipped", "grad_norm")}})
    return rows


def gradient_markdown(rows: list[dict]) -> str:
    def cell(x, fmt):
        return "n/a" if x is None else format(x, fmt)

    lines = [("Gradients (numloss.diagnostics, every step): the term's share of the gradient norm on the "
              "numeric logits (CE's + the term's), its cosine with CE's gradient there, the angle between CE's "
              "gradient and the sum there (turn; its cosine is the part of the sum's length along CE's), the "
              "bound on CE's and the term's gradient on the other columns of the numeric rows over their norm "
              "on the numeric logits (off-block ≤; logged from 2026-12-03 on: n/a before), the fraction of steps "
              "whose pre-clip norm exceeded optim.grad_clip, and the median pre-clip norm; each a mean over the "
              "runs that recorded it (runs shared from the base study predate the diagnostics)."), "",
             "| loss | runs | with diagnostics | term share | cos(term, CE) | turn from CE | off-block ≤, CE "
             "| off-block ≤, term | steps clipped | median grad norm |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        turn = "n/a" if r["turn"] is None else f"{r['turn']:.0f}°"
        lines.append(f"| {r['loss']} | {r['runs']} | {r['diagnosed']} | {cell(r['share'], '.2f')} | "
                     f"{cell(r['cos_ce'], '+.2f')} | {turn} | {cell(r['ce_off'], '.2f')} | {cell(r['term_off'], '.2f')} | "
                     f"{cell(r['clipped'], '.0%')} | {cell(r['grad_norm'], '.1f')} |")
    return "\n".join(lines)


def seed_rows(rows: list[dict], found: list[dict]) -> list[dict]:
    """For each loss compared with CE over at least MIN_SEEDS seeds: the mean and SD of its per-seed
    differences (points), the seeds the t interval would need to exclude 0 if they stayed as observed
    (`seeds_to_exclude_zero`), and what the missing seeds would cost: a run of the loss and one of CE
    per seed, at the mean training time of this regime's runs."""

    train_s = mean_known(r.get("train_seconds") for r in found)
    out = []
    for row in rows:
        t = (row.get("vs_ce") or {}).get("seed_t")
        if not t or t["n"] < MIN_SEEDS:
            continue
        mean, sd = 100 * t["mean"], 100 * t["sd"]
        need = seeds_to_exclude_zero(mean, sd)
        runs = None if need is None else 2 * max(0, need - t["n"])
        out.append({"loss": row["loss"], "seeds": t["n"], "mean": mean, "sd": sd, "need": need, "runs": runs,
                    "hours": None if runs is None or train_s is None else runs * train_s / 3600})
    return out


def seed_markdown(rows: list[dict]) -> str:
    lines = [("Seeds: the mean and standard deviation of the per-seed differences against CE (points), and the "
              "fewest seeds whose 95% t interval would exclude 0 if the differences kept that mean and SD (a "
              "planning figure: the mean of a few seeds is itself that uncertain), with the runs that would take "
              "(the loss and CE at each new seed) and their training time at this regime's mean run on the "
              "machine that ran it."), "",
             "| loss | seeds | Δ mean | Δ SD | seeds to exclude 0 | more runs | training hours |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        need = "> 10000" if r["need"] is None else str(r["need"])
        runs = "n/a" if r["runs"] is None else str(r["runs"])
        hours = "n/a" if r["hours"] is None else f"{r['hours']:.0f}"
        lines.append(f"| {r['loss']} | {r['seeds']} | {r['mean']:+.1f} | {r['sd']:.1f} | {need} | {runs} | {hours} |")
    return "\n".join(lines)


def problem_kind(problem: dict) -> str:
    """The group a test problem falls in for the breakdown: its operation and its answer's sign (the
    sign is a plain CE label, so a term can only help with the digits after it)."""
    q = problem["prompt"]
    op = "product" if ("*" in q or " times " in q or q.startswith("Multiply")) else "add/sub"
    return f"{op}, answer {'< 0' if problem['target'].startswith('-') else '>= 0'}"


def eval_problems(regime: Regime) -> list[dict]:
    """The regime's test problems in evaluation order, made again by the same deterministic generator
    `build_data` used (so a fresh checkout can report), and compared with the work folder's copy where
    one exists: a generator that changed since the runs is an error, not a mispaired table."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        _, path = write_problems(Path(tmp), regime.train_examples, BASE.eval_examples, mix=regime.mix)
        problems = [json.loads(line) for line in path.read_text().splitlines()]
    kept = regime.work / "problems" / "eval.jsonl"
    if kept.exists() and [json.loads(line) for line in kept.read_text().splitlines()] != problems:
        raise ValueError(f"{kept}: the generator no longer makes these test problems; the runs cannot be "
                         f"broken down by problem kind")
    return problems


def kind_rows(found: list[dict], order: list[str], problems: list[dict]) -> list[dict]:
    """Per loss and problem kind: exact match over the kind's problems, mean and standard deviation over
    the loss's runs, and its difference from CE's at the same seeds."""
    kinds = [problem_kind(p) for p in problems]
    groups = sorted(set(kinds))
    per_run = {}
    for r in found:
        if len(r["correct"]) != len(problems):
            raise ValueError(f"{r['name']}: {len(r['correct'])} answers for {len(problems)} test problems")
        per_run[r["loss"], r["seed"]] = {g: statistics.mean(c == "1" for c, k in zip(r["correct"], kinds) if k == g)
                                         for g in groups}  # `correct`: one "1" or "0" per test problem
    rows = []
    for loss in order:
        seeds = sorted(s for (name, s) in per_run if name == loss)
        if not seeds:
            continue
        for g in groups:
            scores = [per_run[loss, s][g] for s in seeds]
            paired = [per_run[loss, s][g] - per_run["ce", s][g] for s in seeds if ("ce", s) in per_run]
            rows.append({"loss": loss, "kind": g, "problems": kinds.count(g), "seeds": len(seeds),
                         "mean": statistics.mean(scores), "sd": statistics.stdev(scores) if len(scores) > 1 else None,
                         "delta": statistics.mean(paired) if paired and loss != "ce" else None,
                         "delta_per_seed": paired if loss != "ce" else []})
    return rows


def kind_markdown(rows: list[dict]) -> str:
    lines = [("Exact match by problem kind (operation, sign of the answer): % over the kind's test problems, "
              "mean ± standard deviation over seeds; Δ vs CE: the mean of the per-seed differences, which "
              "ranks nothing (no interval: a kind holds a fraction of the test problems)."), "",
             "| loss | kind | problems | seeds | exact match % | Δ vs CE (per seed) |", "|---|---|---:|---:|---:|---|"]
    for r in rows:
        spread = "" if r["sd"] is None else f" ± {100 * r['sd']:.1f}"
        delta = "–" if r["delta"] is None else (f"{100 * r['delta']:+.1f} ("
                                                 + ", ".join(f"{100 * d:+.1f}" for d in r["delta_per_seed"]) + ")")
        lines.append(f"| {r['loss']} | {r['kind']} | {r['problems']} | {r['seeds']} | {100 * r['mean']:.1f}{spread} "
                     f"| {delta} |")
    return "\n".join(lines)


def report(regime: Regime, grid: list[str], order: list[str]) -> str:
    """`results.md`, `results.csv` and `curves.png` of a regime from its records; returns the table."""
    import csv


    found = records(regime)
    if not found:
        raise FileNotFoundError(f"{regime.out / 'runs'}: no finished runs to report")
    rows = aggregate(found, order=order)
    before = {p.stem.removeprefix("zero_shot-"): json.loads(p.read_text())
              for p in sorted((BASE.out if regime.base_test_set else regime.out).glob("zero_shot-*.json"))}
    table = "\n".join([f"Regime `{regime.name}`: {regime.question}", "", markdown(rows), *zero_shot_lines(before), "",
                       gradient_markdown(gradient_rows(found, order)), "",
                       seed_markdown(seed_rows(rows, found)), "",
                       kind_markdown(kind_rows(found, order, eval_problems(regime))), *progress_lines(found, grid)])
    (regime.out / "results.md").write_text(table + "\n")
    with open(regime.out / "results.csv", "w", newline="") as f:
        flat = [{k: (json.dumps(v) if isinstance(v, dict) else v) for k, v in row.items()} for row in rows]
        writer = csv.DictWriter(f, fieldnames=list(flat[0]))
        writer.writeheader()
        writer.writerows(flat)
    curves = {r["loss"]: r["curve"] for loss in order for r in found if r["loss"] == loss and r["seed"] == 0}
    if curves:
        plot_curves(curves, str(regime.out / "curves.png"), keys=["ce", "grad_norm", SHARES])
    return table


def plan_runs(order: list[str], seeds: int, only: list[str] | None = None) -> list[tuple[str, int]]:
    """(loss, seed) in the order they run: seed by seed, so that a partial study has whole seeds. `only`
    restricts it to some of the regime's losses (more seeds of one comparison: the loss and CE)."""
    if only:
        unknown = [loss for loss in only if loss not in order]
        if unknown:
            raise ValueError(f"--losses {','.join(unknown)}: not in this regime's grid ({', '.join(order)})")
    return [(loss, s) for s in range(seeds) for loss in order if not only or loss in only]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.regimes", description=__doc__.split("\n")[0])
    parser.add_argument("--regime", choices=list(REGIMES), required=True)
    parser.add_argument("--seeds", type=int, default=DEFAULT_SEEDS)
    parser.add_argument("--losses", default=None,
                        help="comma-separated: run only these of the regime's losses (e.g. ce,dist2_w1 with --seeds 7)")
    parser.add_argument("--budget-min", type=float, default=None,
                        help="start no new run after this many minutes (the study resumes later)")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args(argv)
    regime = REGIMES[args.regime]
    try:
        grid_losses = losses(regime)
    except ValueError as e:
        raise SystemExit(f"regime {regime.name!r}: {e}") from None
    order = list(grid_losses)
    tokenizer = next(iter(BASE.tokenizers))
    try:
        plan = plan_runs(order, args.seeds, args.losses.split(",") if args.losses else None)
    except ValueError as e:
        raise SystemExit(f"regime {regime.name!r}: {e}") from None
    # what the report counts as planned: the regime's whole grid (at the default seeds when --losses
    # adds seeds to one comparison), and this plan
    whole = plan_runs(order, min(args.seeds, DEFAULT_SEEDS) if args.losses else args.seeds)
    grid = list(dict.fromkeys(f"{tokenizer}-{loss}-s{s}" for loss, s in [*whole, *plan]))
    (regime.out / "runs").mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        build_data(BASE, regime.work, regime.train_examples, BASE.eval_examples, mix=regime.mix)
        if not regime.base_test_set:  # its own test problems: the backbone's own score on them
            zero_shot(BASE, regime.work, regime.out)
        started = time.time()
        for i, (loss, seed) in enumerate(plan, 1):
            done = {r["name"] for r in records(regime)}
            if f"{tokenizer}-{loss}-s{seed}" in done:
                continue
            if args.budget_min is not None and time.time() - started > 60 * args.budget_min:
                log(f"{args.budget_min:g} min spent: stopping before {loss} seed {seed}")
                break
            record = run_one(BASE, regime.work, regime.out, tokenizer, loss, seed, None, objective=grid_losses[loss],
                             overrides=regime.overrides + run_overrides(regime, loss), keep_model=False)
            m = record["metrics"]
            log(f"{regime.name} {i}/{len(plan)} {record['name']}: exact match {m['exact_match']}, parse rate "
                f"{m['parse_rate']} ({record['train_seconds']:.0f} s; {(time.time() - started) / 60:.1f} min so far)")
            report(regime, grid, order)  # publish each run as it lands
    print(report(regime, grid, order))
    return 0


if __name__ == "__main__":
    sys.exit(main())
