"""`make demo`: the project's main job at CPU size: CE against CE + SMMD, end to end.

1. data: "a+b" / "a-b" problems from data_prep's arithmetic generator, split into train and held-out
   sets with no problem in both, written as JSONL and built into shards by data_prep (tokenized,
   label-masked, numeric-annotated), with a character-level tokenizer trained on the fly (every digit
   its own token: N = 10 under the "digits" policy);
2. training: `recipes/configs/demo.yaml` (a tiny random Llama) under DeepSpeed ZeRO-3 on 2 CPU ranks
   (torchrun, gloo), once per objective, same data, steps, learning rate and initial weights;
3. evaluation: greedy decoding of the held-out answers (exact match, MAE, R², parse rate), a Markdown
   table, training curves and the digit-distribution probe.

Everything lands in `runs/demo/` (ignored by git). The numbers are whatever this run produced: a few
minutes of CPU training on a tiny model is a test of the whole path, not a result about the losses.

    python -m recipes.demo [--steps N] [--out DIR] [--nproc 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from recipes.local import REPO_ROOT, run_recipe
from recipes.tiny import build_jsonl_shards, train_tokenizer, write_arithmetic_split

RECIPE = REPO_ROOT / "recipes" / "configs" / "demo.yaml"
OBJECTIVES = {"CE": "{terms: {}}", "CE+SMMD": "{terms: {smmd: {}}}"}
GENERATOR = {"min_digits": 1, "max_digits": 2, "terms": 2, "negatives": False, "decimals": 0, "mixed_ops": 2}


def log(message: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {message}", flush=True)


def write_problems(out: Path, n_train: int, n_eval: int, seed: int = 0) -> tuple[Path, Path]:
    """The demo's disjoint train / held-out add/sub problems as JSONL."""
    return write_arithmetic_split(out, n_train, n_eval, [("add_or_sub", GENERATOR)], seed)


def build_data(out: Path, n_train: int, n_eval: int) -> None:
    train_jsonl, eval_jsonl = write_problems(out, n_train, n_eval)
    train_tokenizer([p.read_text() for p in (train_jsonl, eval_jsonl)], out / "tokenizer", style="digits")
    for name, path in (("train", train_jsonl), ("eval", eval_jsonl)):
        totals = build_jsonl_shards(path, out / "tokenizer", out / "data" / name)
        log(f"data/{name}: {totals['examples_kept']} examples, {totals['tokens']} tokens,"
            f" {totals['numeric_tokens']} numeric labels, {totals['rejected']} rejected")


def train_run(name: str, objective: str, out: Path, steps: int | None, nproc: int) -> Path:
    run_dir = out / name.replace("+", "_")
    overrides = [f"name={name}", f"train.out_dir={run_dir}", f"loss.objective={objective}",
                 f"data.train={out / 'data' / 'train'}", f"model.tokenizer={out / 'tokenizer'}"]
    if steps is not None:
        overrides.append(f"train.steps={steps}")
    log(f"training {name}: {nproc} DeepSpeed ZeRO-3 ranks on CPU")
    seconds = run_recipe(RECIPE, overrides, nproc)
    log(f"trained {name} in {seconds:.0f} s")
    return run_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(REPO_ROOT / "runs" / "demo"))
    parser.add_argument("--steps", type=int, default=None, help="override train.steps of the demo recipe")
    parser.add_argument("--nproc", type=int, default=2, help="DeepSpeed ranks (processes)")
    parser.add_argument("--train-examples", type=int, default=6000)
    parser.add_argument("--eval-examples", type=int, default=300)
    args = parser.parse_args(argv)

    from recipes.evaluate import evaluate
    from recipes.report import markdown_table, plot_curves, plot_probe, probe_model, read_metrics_jsonl

    out = Path(args.out)
    build_data(out, args.train_examples, args.eval_examples)
    runs = {name: train_run(name, objective, out, args.steps, args.nproc) for name, objective in OBJECTIVES.items()}

    results, curves, probes = [], {}, {}
    for name, run_dir in runs.items():
        log(f"evaluating {name} on {args.eval_examples} held-out problems")
        results.append(evaluate(str(run_dir / "final"), str(out / "data" / "eval"), out=str(run_dir / "eval.json"),
                                batch_size=64, max_new_tokens=8, name=name))
        curves[name] = read_metrics_jsonl(str(run_dir / "metrics.jsonl"))
        probes[name] = probe_model(str(run_dir / "final"), str(out / "data" / "eval"), limit=args.eval_examples)
    table = markdown_table(results)
    (out / "results.md").write_text(table + "\n")
    plot_curves(curves, str(out / "curves.png"))
    plot_probe(probes, str(out / "probe.png"))
    print()
    print(table)
    print()
    log(f"table {out / 'results.md'}, plots {out / 'curves.png'} and {out / 'probe.png'},"
        f" per-example predictions in {out}/*/eval.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
