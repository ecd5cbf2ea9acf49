"""Render a SLURM batch script for a recipe: a Ray cluster inside the allocation, or srun + torchrun.

    python -m launch.slurm RECIPE.yaml --mode ray      --out job.sbatch [key=value ...]
    python -m launch.slurm RECIPE.yaml --mode torchrun --out job.sbatch [key=value ...]
    sbatch job.sbatch

The allocation comes from the recipe's `cluster` section: `nodes`, `gpus_per_node` (or
`cpu_ranks_per_node` on CPU), `cpus_per_worker` (CPUs per rank), `container` (an image for
pyxis/enroot's `srun --container-image`; none: run on the host environment), `partition`, `time_limit`,
`mem` (per node), `hf_home`, `hf_offline`, `nccl_debug`, `nccl_socket_ifname`.

Every step: `srun --cpus-per-task` (Slurm 22.05-23.02 do not pass sbatch's value on to srun, and
without it every rank of a node shares one core) and `--kill-on-bad-exit=1` (one failed node ends the
job instead of leaving the others waiting in a collective until the time limit). The rendezvous is the
first node's IP address, not its hostname (which may resolve to another interface, or not at all
inside a container). The environment: HF_HOME (`cluster.hf_home`), HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE
(`cluster.hf_offline`), NCCL_DEBUG, NCCL_SOCKET_IFNAME (when given), TORCH_NCCL_ASYNC_ERROR_HANDLING.
In a container the checkout, the recipe's data directories (data.train, data.eval, eval.data), its
train.out_dir (created), local model/tokenizer directories and HF_HOME are mounted at their own paths.
The recipe's `loss.plugins` are imported while the script is rendered (a bad one is refused here); each
directory one was found in outside the installed packages and the checkout is put on the job's
PYTHONPATH and mounted, since every rank imports them again (an installed plugin must be installed on
the nodes, or in the container image).

- ray: `ray start --head` on the first node, `ray start --address` on the others (each a background
  srun step), a wait until every node has joined, then the driver, `python -m launch.ray RECIPE
  --address HEAD:PORT`, on the head node; Ray places one worker per GPU and restarts the group from
  the latest checkpoint up to `--max-failures` times.
- torchrun: one `srun` task per node running torchrun with `--nproc_per_node` = GPUs per node and a
  c10d rendezvous on the first node; no restarts inside the job (requeue the job; the recipe resumes
  from `latest` by itself).

Preemption (recipes.reliability.preemption): with `cluster.preempt_notice_s` N > 0 (default 300) the script
asks for `--signal=B:USR1@N` and `--requeue`. SLURM then signals the batch shell N seconds before the
time limit; its trap writes `<out_dir>/PREEMPT`, which rank 0 sees at the end of the current step: every
rank saves a checkpoint and exits (75), and the script runs `scontrol requeue` so the job starts again
and resumes from that checkpoint. The file, not a signal passed down, because the batch shell is the
one process SLURM signals with `B:`, and neither srun, torchrun nor Ray pass a SIGUSR1 on to the ranks.
A preemption by SLURM itself (SIGTERM to every process of the job) reaches the ranks directly:
torchrun passes SIGTERM on, and they save the same way within the grace time.

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
from recipes.planning.save_time import torchrun_shutdown_timeout_s
from recipes.plugins import import_roots

TEMPLATES = Path(__file__).resolve().parent / "templates"
MODES = ("ray", "torchrun")

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}")
_PARTITION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_,.-]{0,127}")
_TIME = re.compile(r"(\d+-)?\d{1,3}(:\d{2}){0,2}|(\d+-)\d{1,2}(:\d{2}){0,2}")
_IMAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_./:@#+-]{0,254}")
_MEM = re.compile(r"\d{1,9}[KMGT]?")
_WORD = re.compile(r"[A-Za-z0-9_]{1,32}")
_IFNAME = re.compile(r"\^?[A-Za-z0-9_.=-]{1,64}(,[A-Za-z0-9_.=-]{1,64}){0,15}")
_PATH = re.compile(r"[A-Za-z0-9_./~+@-][A-Za-z0-9_./~+@ -]{0,1023}")
_MOUNTABLE = re.compile(r"[^,:\n\x00]{1,4096}")  # pyxis' --container-mounts syntax; the value is quoted
_PLUGIN_DIR = re.compile(r"/[^,:\n\x00]{0,4095}")  # absolute; ':' separates PYTHONPATH, ',' the mounts


def _looks_local(name: str) -> bool:
    """A model/tokenizer given as a path (mounted) rather than a hub name such as org/model."""
    return name.startswith(("/", "./", "../", "~")) or Path(name).exists()


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
    notice = _positive(c.preempt_notice_s, "cluster.preempt_notice_s", zero_ok=True)
    if notice:  # the batch shell gets SIGUSR1 ahead of the limit; its trap asks the run to save and stop
        header += [f"#SBATCH --signal=B:USR1@{notice}", "#SBATCH --requeue"]
    if gpus:
        header.append(f"#SBATCH --gpus-per-node={gpus}")
    if c.partition:
        header.append(f"#SBATCH --partition={_check(c.partition, _PARTITION, 'cluster.partition')}")
    if output:
        # %x/%j are sbatch's own patterns; only safe characters are allowed in the path
        header.append(f"#SBATCH --output={_check(output, re.compile(r'[A-Za-z0-9_./%-]{1,255}'), '--output')}")
    mem = _check(c.mem, _MEM, "cluster.mem")
    header.append(f"#SBATCH --mem={mem}")
    container = ""
    if c.container:
        image = _check(c.container, _IMAGE, "cluster.container")
        # the checkout on shared storage is mounted at the same path and is the working directory, so
        # the recipe's relative paths resolve and its code shadows the image's installed copy; the
        # script adds the data, output and HF_HOME directories (MOUNTS, built at run time)
        container = f"--container-image={q(image)} --container-mounts=\"$MOUNTS\" " \
                    f"--container-workdir=\"$WORKDIR\" "
    env = [f"export NCCL_DEBUG={q(_check(c.nccl_debug, _WORD, 'cluster.nccl_debug'))}",
           "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
           # torchrun passes a SIGTERM on to the ranks, then kills them after this many seconds (30 by
           # default): long enough for them to finish the step and save a checkpoint first (what a save of
           # a given size needs, and validate's warning when it does not fit: recipes.planning.save_time)
           f"export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={torchrun_shutdown_timeout_s(notice)}"]
    if c.nccl_socket_ifname:
        env.append(f"export NCCL_SOCKET_IFNAME={q(_check(c.nccl_socket_ifname, _IFNAME, 'cluster.nccl_socket_ifname'))}")
    if c.hf_home:
        env.append(f"export HF_HOME={q(_check(c.hf_home, _PATH, 'cluster.hf_home'))}")
    if c.hf_offline:
        env.append("export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1")
    # every rank (and Ray worker) loads the recipe and imports loss.plugins: the directories this process
    # found them in go on PYTHONPATH (and into the container's mounts); installed ones must be on the nodes
    plugin_dirs = [_check(d, _PLUGIN_DIR, f"loss.plugins ({d})") for d in import_roots(recipe.loss.plugins)]
    if plugin_dirs:
        env.append(f"export PYTHONPATH={q(':'.join(plugin_dirs))}\"${{PYTHONPATH:+:$PYTHONPATH}}\"")
    mounts = {"data.train": recipe.data.train, "data.eval": recipe.data.eval, "eval.data": recipe.eval.data,
              "train.out_dir": recipe.train.out_dir, "cluster.hf_home": c.hf_home}
    for key in ("name_or_path", "tokenizer"):
        value = getattr(recipe.model, key)
        if value and _looks_local(value):
            mounts[f"model.{key}"] = value
    mounts.update({f"loss.plugins ({d})": d for d in plugin_dirs})
    mount_paths = " ".join(dict.fromkeys(q(_check(v, _MOUNTABLE, k)) for k, v in mounts.items() if v))
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
        "ENV": "\n".join(env),
        "MOUNT_PATHS": mount_paths,
        "OUT_DIR": q(recipe.train.out_dir),
        "CPUS_PER_TASK": str(cpus * workers_per_node),
        "RECIPE_ARGS": recipe_arg,
        "MAX_FAILURES": str(max_failures),
        "PREEMPT": "1" if notice else "0",
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
