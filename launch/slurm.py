"""Render a SLURM batch script for a recipe: a Ray cluster inside the allocation, or srun + torchrun.

    python -m launch.slurm RECIPE.yaml --mode ray      --out job.sbatch [key=value ...]
    python -m launch.slurm RECIPE.yaml --mode torchrun --out job.sbatch [key=value ...]
    sbatch job.sbatch

The allocation comes from the recipe's `cluster` section: `nodes`, `gpus_per_node` (or
`cpu_ranks_per_node` on CPU), `cpus_per_worker` (CPUs per rank), `container` (an image for
pyxis/enroot's `srun --container-image`; none: run on the host environment), `partition`, `time_limit`.

- ray: `ray start --head` on the first node, `ray start --address` on the others (each a background
  srun step), a wait until every node has joined, then the driver, `python -m launch.ray RECIPE
  --address HEAD:PORT`, on the head node; Ray places one worker per GPU and restarts the group from
  the latest checkpoint up to `--max-failures` times.
- torchrun: one `srun` task per node running torchrun with `--nproc_per_node` = GPUs per node and a
  c10d rendezvous on the first node; no restarts inside the job (requeue the job; the recipe resumes
  from `latest` by itself).

Nothing from the recipe or the command line reaches the script unquoted: every value is validated
(names, partition, time, image, integers) and then inserted with shlex.quote.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path
from string import Template

from recipes.config import load_recipe

TEMPLATES = Path(__file__).resolve().parent / "templates"
MODES = ("ray", "torchrun")

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}")
_PARTITION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_,.-]{0,127}")
_TIME = re.compile(r"(\d+-)?\d{1,3}(:\d{2}){0,2}|(\d+-)\d{1,2}(:\d{2}){0,2}")
_IMAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_./:@#+-]{0,254}")


def _check(value: str, pattern: re.Pattern, what: str) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise ValueError(f"{what}: {value!r} is not a valid value (allowed: {pattern.pattern})")
    return value


def _positive(value, what: str, zero_ok: bool = False) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < (0 if zero_ok else 1):
        raise ValueError(f"{what}: expected an integer >= {0 if zero_ok else 1}, got {value!r}")
    return value


def render(recipe_path: str | Path, mode: str, overrides: list[str] | tuple = (), *, max_failures: int = 3,
           port: int = 6379, rdzv_port: int = 29500, workdir: str | None = None,
           output: str | None = None) -> str:
    """The batch script as text (see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"--mode: {mode!r} is not one of {list(MODES)}")
    recipe = load_recipe(recipe_path, overrides)
    c = recipe.cluster
    nodes = _positive(c.nodes, "cluster.nodes")
    gpus = _positive(c.gpus_per_node, "cluster.gpus_per_node", zero_ok=True)
    cpus = _positive(c.cpus_per_worker, "cluster.cpus_per_worker")
    name = _check(recipe.name, _NAME, "name")
    time_limit = _check(c.time_limit, _TIME, "cluster.time_limit")
    _positive(max_failures + 1, "--max-failures + 1")
    for p, what in ((port, "--port"), (rdzv_port, "--rdzv-port")):
        if not (isinstance(p, int) and 1024 <= p <= 65535):
            raise ValueError(f"{what}: {p!r} is not a port in 1024-65535")
    workers_per_node = _positive(c.ranks_per_node(), "cluster.cpu_ranks_per_node")
    q = shlex.quote
    header = [f"#SBATCH --job-name={name}", f"#SBATCH --nodes={nodes}", "#SBATCH --ntasks-per-node=1",
              f"#SBATCH --cpus-per-task={cpus * workers_per_node}", f"#SBATCH --time={time_limit}",
              "#SBATCH --exclusive"]
    if gpus:
        header.append(f"#SBATCH --gpus-per-node={gpus}")
    if c.partition:
        header.append(f"#SBATCH --partition={_check(c.partition, _PARTITION, 'cluster.partition')}")
    if output:
        # %x/%j are sbatch's own patterns; only safe characters are allowed in the path
        header.append(f"#SBATCH --output={_check(output, re.compile(r'[A-Za-z0-9_./%-]{1,255}'), '--output')}")
    container = ""
    if c.container:
        image = _check(c.container, _IMAGE, "cluster.container")
        # the checkout on shared storage is mounted at the same path and is the working directory, so
        # the recipe's relative paths resolve and its code shadows the image's installed copy
        container = f"--container-image={q(image)} --container-mounts=\"$WORKDIR:$WORKDIR\" " \
                    f"--container-workdir=\"$WORKDIR\" "
    recipe_arg = " ".join(q(a) for a in [str(recipe_path), *overrides])
    values = {
        "HEADER": "\n".join(header),
        "NAME": q(name),
        "NODES": str(nodes),
        "GPUS_PER_NODE": str(gpus),
        "CPUS_PER_NODE": str(cpus * workers_per_node),
        "WORKERS_PER_NODE": str(workers_per_node),
        "WORKDIR": q(workdir) if workdir else '"${SLURM_SUBMIT_DIR:-$PWD}"',
        "CONTAINER": container,
        "RECIPE_ARGS": recipe_arg,
        "MAX_FAILURES": str(max_failures),
        "PORT": str(port),
        "RDZV_PORT": str(rdzv_port),
    }
    text = Template((TEMPLATES / f"{mode}.sbatch").read_text()).substitute(values)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.slurm", description=__doc__.split("\n")[0])
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*", help="key.path=value recipe overrides (also passed to the job)")
    p.add_argument("--mode", choices=MODES, default="ray")
    p.add_argument("--out", default=None, help="write the script here (default: stdout)")
    p.add_argument("--max-failures", type=int, default=3, help="ray mode: group restarts allowed")
    p.add_argument("--port", type=int, default=6379, help="ray mode: the head's GCS port")
    p.add_argument("--rdzv-port", type=int, default=29500, help="torchrun mode: the rendezvous port")
    p.add_argument("--workdir", default=None, help="the project checkout on shared storage (default: sbatch's"
                                                    " submit directory)")
    p.add_argument("--output", default=None, help="sbatch --output pattern, e.g. logs/%%x-%%j.out")
    args = p.parse_intermixed_args(argv)
    try:
        text = render(args.recipe, args.mode, args.overrides, max_failures=args.max_failures, port=args.port,
                      rdzv_port=args.rdzv_port, workdir=args.workdir, output=args.output)
    except (ValueError, FileNotFoundError) as err:
        print(f"launch.slurm: {err}", file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out).chmod(0o755)
        print(f"wrote {args.out} ({args.mode}); submit with: sbatch {shlex.quote(args.out)}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
