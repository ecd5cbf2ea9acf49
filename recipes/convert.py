"""Convert a recipe's Hugging Face backbone once into a megatron-core distributed checkpoint, which training
then starts from at any TP / PP layout with `megatron.load_converted: DIR`
(`recipes.engines.megatron.runtime.converted`), instead of every rank converting the safetensors at every start.

    python -m recipes.convert RECIPE.yaml --out DIR [key=value ...]
    torchrun --nproc_per_node 8 -m recipes.convert RECIPE.yaml --out DIR --tp 8 [key=value ...]

The conversion's own layout (`--tp` x `--pp`, default 1 x 1, and the world size must be their product)
only splits the work and the host memory: one process holds the whole model in `model.dtype` (140 GB
at 70B in bf16); at `--tp 8` each rank reads and holds an eighth. The result is the same either way and
loads at any layout. It is written into `DIR.partial` and renamed to DIR when complete.

Exit status: 0 converted (rank 0 prints a JSON line: where, what, the HF bytes read, seconds); 2 refused
before anything is read (the recipe or an override is wrong, `train.engine` is not megatron, the model is
not an HF checkpoint, DIR exists, the world is not tp x pp); 1 the conversion failed (DIR is not written;
the next attempt removes DIR.partial).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from recipes.config import load_recipe
from recipes.engines import ENGINES, engine_contract
from recipes.engines.runtime import runtime_object

EXIT_REFUSED = 2


def refusals(recipe, out: Path, tp: int, pp: int, world: int) -> list[str]:
    """Why this conversion cannot start (every rank checks the same; nothing read but the file system)."""
    problems = []
    if engine_contract(recipe).converter is None:
        converting = " or ".join(name for name, engine in ENGINES.items() if engine.converter is not None)
        problems.append(f"train.engine: {recipe.train.engine!r} has no weight format of its own to convert into "
                        f"(train.engine: {converting})")
    if recipe.model.name_or_path is None:
        problems.append("model.name_or_path: none (the model is built from model.config, random weights): nothing "
                        "to convert")
    if out.exists():
        problems.append(f"--out {out} exists; remove it or convert into another directory")
    if tp < 1 or pp < 1 or world != tp * pp:
        problems.append(f"--tp {tp} x --pp {pp} must equal the world size {world} (launch tp x pp processes)")
    return problems


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m recipes.convert", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the recipe")
    parser.add_argument("--out", required=True, type=Path, help="the directory to create")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the conversion (default 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages of the conversion (default 1)")
    args = parser.parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except (ValueError, FileNotFoundError) as err:
        print(f"[numloss] {err}", file=sys.stderr, flush=True)
        sys.exit(EXIT_REFUSED)
    problems = refusals(recipe, args.out, args.tp, args.pp, int(os.environ.get("WORLD_SIZE", "1")))
    if problems:
        print("[numloss] recipes.convert refused:\n" + "\n".join(f"  {p}" for p in problems), file=sys.stderr,
              flush=True)
        sys.exit(EXIT_REFUSED)
    summary = runtime_object(engine_contract(recipe).converter)(recipe, args.out, args.tp, args.pp)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
