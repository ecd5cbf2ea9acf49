"""Tokens per second of the two engines on the same model, data and layout, measured in one run.

    python benchmarks/bench_engines.py [--steps 12] [--hidden 256] [--layers 4] [--nproc 2] [--rounds 2]

`recipes.train` is run as a real torchrun job (CPU ranks, gloo, fp32) on one HF checkpoint saved once
(a Llama with random weights, GQA, tied embeddings), the same data_prep shards (generated arithmetic,
plain template) and the same objective (CE + SMMD), once with `train.engine=deepspeed` (ZeRO-2) and once
with `train.engine=megatron` (DP = nproc), data-parallel over `--nproc` ranks in both, the engines
alternating for `--rounds` rounds. Each run's tokens/s is the median over its steps after the first two
(start-up, first allocation); the ratio megatron / deepspeed is taken within a round. On CPU this
measures the engines' own overheads (DeepSpeed's ZeRO bookkeeping and gloo collectives, megatron-core's
schedule, DDP buckets, the transposed logits copy of the loss function), not what a GPU would show: a ratio,
not a target. Also checks that both engines logged the same step-1 loss (the comparison is fair).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def workspace(root: Path, hidden: int, layers: int) -> Path:
    """A tokenizer, shards and an HF checkpoint in `root`; returns the recipe path."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from data_prep.sources.base import SourceConfig
    from recipes.experiments.tiny import build_plain_shards, tiny_llama_config, train_tokenizer

    train_tokenizer(["Calculate 0123456789 + - * / = . ( ) What is"], root / "tok", "digits")
    build_plain_shards(SourceConfig("arithmetic", options={"n": 2048, "max_digits": 3, "negatives": False}),
                       root / "tok", root / "data", max_length=48)
    tok = AutoTokenizer.from_pretrained(str(root / "tok"))
    cfg = dict(tiny_llama_config(len(tok), hidden=hidden, layers=layers, heads=8, kv_heads=4))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg)).save_pretrained(
        str(root / "model"))
    tok.save_pretrained(str(root / "model"))
    recipe = {"name": "bench-engines", "model": {"name_or_path": str(root / "model"), "dtype": "float32"},
              "data": {"train": str(root / "data")}, "loss": {"objective": {"terms": {"smmd": {}}}},
              "optim": {"lr": 1e-4, "schedule": "constant"},
              "train": {"micro_batch_size": 8, "grad_accum": 2, "save_every": 0, "export": False,
                        "progress": False, "tensorboard": False}}
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def run(recipe: Path, out: Path, engine: str, steps: int, nproc: int) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "recipes.train", str(recipe), f"train.out_dir={out}", f"train.steps={steps}",
           f"train.engine={engine}", "deepspeed.zero_stage=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode:
        raise SystemExit(f"{engine} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-engines-") as tmp:
        root = Path(tmp)
        recipe = workspace(root, args.hidden, args.layers)
        print(f"Llama hidden {args.hidden}, {args.layers} layers; {args.nproc} CPU ranks, data-parallel; "
              f"16 rows of <=48 tokens per rank per step; CE + SMMD; fp32", flush=True)
        print("| round | deepspeed tokens/s | megatron tokens/s | megatron / deepspeed | step-1 loss (ds, mg) |")
        print("|---:|---:|---:|---:|---|")
        ratios = []
        for r in range(args.rounds):
            rows = {engine: run(recipe, root / f"{engine}-{r}", engine, args.steps, args.nproc)
                    for engine in (("deepspeed", "megatron") if r % 2 == 0 else ("megatron", "deepspeed"))}
            speed = {e: statistics.median(row["tokens_per_s"] for row in rs[2:]) for e, rs in rows.items()}
            ratios.append(speed["megatron"] / speed["deepspeed"])
            first = rows["deepspeed"][0]["loss"], rows["megatron"][0]["loss"]
            print(f"| {r + 1} | {speed['deepspeed']:.0f} | {speed['megatron']:.0f} | {ratios[-1]:.2f} | "
                  f"{first[0]:.6f}, {first[1]:.6f} |", flush=True)
        print(f"\nmegatron / deepspeed tokens/s: median {statistics.median(ratios):.2f} over {len(ratios)} rounds")


if __name__ == "__main__":
    main()
