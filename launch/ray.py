"""Run a recipe as a multi-node DeepSpeed job placed, watched and restarted by Ray Train.

    python -m launch.ray RECIPE.yaml [key=value ...]                      # a local Ray instance on loopback
    python -m launch.ray RECIPE.yaml --address HEAD:6379 --max-failures 3 # join a running cluster
    python -m launch.ray submit --address http://HEAD:8265 RECIPE.yaml [key=value ...] [--max-failures N]
                                                                          # a Ray job (needs the dashboard)
    (the job runs `python` on the head's PATH: `--python /path/to/venv/bin/python` where that is not the
    project's environment)

Placement: one worker per GPU (`cluster.nodes` x `cluster.gpus_per_node`), or on CPU
`cluster.cpu_ranks_per_node` workers per node, each with `cluster.cpus_per_worker` CPUs; a placement
group with strategy PACK (`--placement` to change it) fills a node before the next. Ray's TorchTrainer
initialises torch.distributed (NCCL on GPUs, gloo on the CPU) and sets RANK/LOCAL_RANK/WORLD_SIZE/
MASTER_ADDR; `recipes.train.train` runs unchanged in every worker (DeepSpeed reuses that process
group; `prepare_model` is not used).

Ranks: Ray numbers workers in the order its actors came up, which can change across a restart. The
workers re-number themselves by (node IP, Ray node id, local rank) and re-form the process group when
that order differs from Ray's, so the same nodes hold the same ranks after every restart of the group;
the map is written to `<out_dir>/ranks.json` (one line per start in `ranks.jsonl`; a rank that moved
node, because a node was replaced, is reported).

Fault tolerance and the source of truth for resume: the run's own `<train.out_dir>/checkpoints/latest`
marker. `recipes.train` moves it (atomic rename) only after every rank's shard is on disk, and resumes
from it by itself, so `train.out_dir` must be on storage every node sees (it is checked at start). Ray
gets a small *pointer* checkpoint ({step, tag, path}) for each checkpoint, reported from rank 0 with
`ray.train.report` and waited on (`get_all_reported_checkpoints(COMMITTED)`) before training goes on,
so Ray's committed state never lags the marker by more than the checkpoint being written; the sharded
DeepSpeed files are never copied into Ray's storage. With `FailureConfig(max_failures=N)` a dead worker
or node restarts the whole group, which resumes from `latest`. If the two ever disagree (a crash
between the rename and Ray's commit), `latest` wins: it only ever names a complete checkpoint.

Preemption: a worker asked to stop (SIGTERM/SIGUSR1 where the handler could be installed, or
`<out_dir>/PREEMPT`) finishes its step, saves, and fails with `recipes.reliability.preemption.Preempted`:
a restartable failure, so Ray restarts the group from that checkpoint (it counts against
`--max-failures`, like any failure).

Ray's own run state lives in `<train.out_dir>/ray` under the recipe's name, so launching the same recipe
again continues it (Ray and `latest` agree on that).

The recipe's `loss.plugins` (terms of the user's): the driver imports them when it loads the recipe, and
every worker again when it loads the recipe it is sent. A plugin found outside the installed packages and
the checkout goes to the workers' sys.path as the driver found it (`recipes.plugins.import_roots`: the same
path on every node, as Ray assumes of the driver's working directory, which it puts there itself).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path

import ray

from recipes.config import load_recipe, recipe_from_dict
from recipes.plugins import import_roots

REPO = Path(__file__).resolve().parents[1]
POINTER = "numloss_checkpoint.json"
FAULT_ENV = "NUMLOSS_FAULT"  # test-only: "STEP:RANK" -> that rank SIGKILLs itself once after that step
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
DEFAULT_TEMP = os.environ.get("NUMLOSS_RAY_TMP", "/tmp/numloss-ray")  # short: Ray's socket paths live under it


# ---- the Ray instance --------------------------------------------------------------------------------


def connect(address: str | None = None, num_cpus: int | None = None, num_gpus: int | None = None,
            temp_dir: str | None = None) -> None:
    """Join the cluster at `address`, or start a local instance bound to loopback in its own temp dir."""
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    temp = temp_dir or DEFAULT_TEMP
    Path(temp).mkdir(parents=True, exist_ok=True)
    # Ray rewrites 127.0.0.1 to the host's routable address (and then cannot reach a loopback-bound
    # GCS) unless it treats this as a single-host instance; the processes it spawns inherit the env.
    os.environ[LOOPBACK_ENV] = "0"
    ray._private.ray_constants.ENABLE_RAY_CLUSTER = False
    # address="local": never attach to some other Ray instance that happens to run on this host
    ray.init(address="local", _node_ip_address="127.0.0.1", _temp_dir=temp, include_dashboard=False,
             num_cpus=num_cpus, num_gpus=num_gpus, log_to_driver=True,
             runtime_env={"worker_process_setup_hook": "launch.ray.quiet_placement_group_cleaner"})


PG_CLEANER_LOGGER = "ray.train.v2._internal.execution.controller.placement_group_cleaner"


def quiet_placement_group_cleaner() -> None:
    """Every worker of a local instance runs this first (worker_process_setup_hook). Ray Train's
    PlacementGroupCleaner asks the state API once a second whether the run's controller lives; without
    a dashboard there is no state API, and it warned on every try, a line a second in the job's log for
    the whole run. It could not clean anything here anyway (a local instance ends with its driver), so
    its warnings below ERROR are dropped; other loggers keep their levels."""
    import logging

    logging.getLogger(PG_CLEANER_LOGGER).setLevel(logging.ERROR)


# ---- placement ---------------------------------------------------------------------------------------


def scaling(recipe, num_workers: int | None = None, placement: str = "PACK"):
    """ScalingConfig for a recipe: one worker per GPU, or `cluster.cpu_ranks_per_node` per node on CPU."""
    from ray.train import ScalingConfig

    c = recipe.cluster
    gpus = c.gpus_per_node
    workers = num_workers or c.nodes * c.ranks_per_node()
    resources = {"CPU": c.cpus_per_worker}
    if gpus:
        resources["GPU"] = 1
    return ScalingConfig(num_workers=workers, use_gpu=bool(gpus), resources_per_worker=resources,
                         placement_strategy=placement)


def torch_config(recipe):
    """Ray's process group: NCCL on GPUs, gloo on CPU, with the recipe's collective timeout (the same
    one recipes.train gives a group it creates itself)."""
    from ray.train.torch import TorchConfig

    return TorchConfig(backend="nccl" if recipe.cluster.gpus_per_node else "gloo",
                       timeout_s=int(recipe.train.dist_timeout_minutes * 60))


def _absolute_paths(data: dict, base: Path) -> dict:
    """Paths in the recipe made absolute on the driver: workers run in other directories."""
    def fix(section: str, key: str, must_exist: bool = False):
        value = data.get(section, {}).get(key)
        if value and not os.path.isabs(value):
            path = (base / value)
            if not must_exist or path.exists():
                data[section][key] = str(path.resolve())

    fix("data", "train"), fix("data", "eval"), fix("eval", "data"), fix("train", "out_dir")
    fix("model", "tokenizer", must_exist=True), fix("model", "name_or_path", must_exist=True)
    return data


# ---- inside every worker -----------------------------------------------------------------------------


def _stable_ranks(out_dir: Path, timeout=None) -> dict:
    """Re-number the workers by (node IP, Ray node id, local rank); re-form the process group if that
    differs from Ray's order. Returns this worker's entry of the rank map."""
    import torch.distributed as dist

    ctx = ray.get_runtime_context()
    me = {"node_ip": ray.util.get_node_ip_address(), "node_id": ctx.get_node_id(),
          "hostname": socket.gethostname(), "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
          "ray_rank": dist.get_rank()}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, me)
    order = sorted(range(len(everyone)), key=lambda r: (everyone[r]["node_ip"], everyone[r]["node_id"],
                                                         everyone[r]["local_rank"]))
    new_rank = {old: new for new, old in enumerate(order)}
    if any(old != new for old, new in new_rank.items()):
        # the new rank 0 names the rendezvous; agreed over Ray's group before it goes
        addr_port = [None]
        if new_rank[dist.get_rank()] == 0:
            with socket.socket() as s:
                s.bind((me["node_ip"], 0))
                addr_port = [(me["node_ip"], s.getsockname()[1])]
        src = order[0]
        dist.broadcast_object_list(addr_port, src=src)
        backend = dist.get_backend()
        rank = new_rank[dist.get_rank()]
        dist.destroy_process_group()
        os.environ.update(RANK=str(rank), MASTER_ADDR=addr_port[0][0], MASTER_PORT=str(addr_port[0][1]))
        dist.init_process_group(backend=backend, init_method="env://", rank=rank,
                                world_size=len(everyone), timeout=timeout)
    ranks = {new_rank[r]: {k: v for k, v in e.items() if k != "ray_rank"} for r, e in enumerate(everyone)}
    if dist.get_rank() == 0:
        path = out_dir / "ranks.json"
        if path.is_file():
            before = {int(k): v for k, v in json.loads(path.read_text()).items()}
            moved = [r for r in ranks if r in before and before[r]["node_id"] != ranks[r]["node_id"]]
            if moved:
                print(f"[launch.ray] ranks {moved} now run on other nodes than before the restart "
                      f"(a node was replaced); the checkpoint on shared storage still lines up", flush=True)
        out_dir.mkdir(parents=True, exist_ok=True)
        with (out_dir / "ranks.jsonl").open("a") as f:  # one line per (re)start of the group
            f.write(json.dumps({str(r): ranks[r] for r in sorted(ranks)}) + "\n")
        tmp = out_dir / ".ranks.json.tmp"
        tmp.write_text(json.dumps({str(r): ranks[r] for r in sorted(ranks)}, indent=1))
        os.replace(tmp, path)
    return ranks[dist.get_rank()]


def _check_shared_storage(out_dir: Path) -> None:
    """Every rank must see what rank 0 writes in out_dir (checkpoints, `latest`, per-rank states)."""
    import torch.distributed as dist

    token = [None]
    if dist.get_rank() == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        token = [f"{os.getpid()}-{time.time_ns()}"]
        (out_dir / ".shared_probe").write_text(token[0])
    dist.broadcast_object_list(token, src=0)
    probe = out_dir / ".shared_probe"
    seen = probe.read_text() if probe.is_file() else None
    ok = [seen == token[0]]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ok[0])
    if not all(everyone):
        raise RuntimeError(f"train.out_dir={out_dir} is not shared: ranks {[r for r, o in enumerate(everyone) if not o]}"
                           " do not see rank 0's files; checkpoints need storage every node sees")


def train_loop(config: dict) -> None:
    """The function every Ray worker runs: recipes.train.train with hooks that report to Ray."""
    import torch.distributed as dist
    from ray.train import Checkpoint, CheckpointConsistencyMode

    from recipes.engines.runtime import engine_class
    from recipes.train import Hooks, train

    # the driver's plugin directories first, so that loading the recipe imports loss.plugins here as there
    sys.path[:0] = [p for p in config.get("plugin_paths", []) if p not in sys.path]
    recipe = recipe_from_dict(config["recipe"])
    out_dir = Path(recipe.train.out_dir)
    if config.get("run_id"):  # a restarted worker group takes this run's own out_dir lock back (run_lock)
        os.environ["NUMLOSS_RUN_ID"] = config["run_id"]
    _stable_ranks(out_dir, datetime.timedelta(minutes=recipe.train.dist_timeout_minutes))
    # adopts Ray's process group (recipes.training.runtime), set up as the recipe's engine needs it
    engine_class(recipe).join_process_group(recipe.train.dist_timeout_minutes)
    _check_shared_storage(out_dir)
    rank = dist.get_rank()
    state: dict = {"row": {}}
    fault = config.get("fault")  # test-only fault injection, see FAULT_ENV

    previous = ray.train.get_checkpoint()
    if previous is not None and rank == 0:
        with previous.as_directory() as d:
            pointer = json.loads((Path(d) / POINTER).read_text())
        marker = out_dir / "checkpoints" / "latest"
        print(f"[launch.ray] restart: Ray's last committed checkpoint is step {pointer['step']};"
              f" resuming from {marker.read_text().strip() if marker.is_file() else 'nothing'} (latest)",
              flush=True)

    def on_log(row: dict) -> None:
        state["row"] = row
        if fault and row["step"] == fault["step"] and rank == fault["rank"]:
            flag = out_dir / f".fault_injected_step{fault['step']}_rank{fault['rank']}"
            if not flag.exists():
                flag.write_text("killed\n")
                print(f"[launch.ray] fault injection: rank {rank} SIGKILLs itself after step {row['step']}",
                      flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    def on_checkpoint(step: int, path: Path) -> None:
        metrics = {**state["row"], "checkpoint_step": step}
        if rank == 0:
            with tempfile.TemporaryDirectory(prefix="numloss-pointer-") as tmp:
                (Path(tmp) / POINTER).write_text(json.dumps(
                    {"step": step, "tag": Path(path).name, "path": str(path), "out_dir": str(out_dir)}))
                ray.train.report(metrics, checkpoint=Checkpoint.from_directory(tmp),
                                 checkpoint_dir_name=f"pointer_{Path(path).name}")
        else:
            ray.train.report(metrics, checkpoint=None, checkpoint_dir_name=f"pointer_{Path(path).name}")
        # durable before training moves on: Ray has persisted and registered the pointer
        ray.train.get_all_reported_checkpoints(consistency_mode=CheckpointConsistencyMode.COMMITTED)

    from recipes.reliability.preemption import Preempted

    try:
        train(recipe, Hooks(on_log=on_log, on_checkpoint=on_checkpoint))
    except Preempted as err:  # saved at this step: a failure Ray restarts from it (--max-failures)
        print(f"[launch.ray] rank {rank}: {err}; failing this attempt so Ray restarts the group", flush=True)
        raise


# ---- the driver --------------------------------------------------------------------------------------


def parse_fault(spec: str | None) -> dict | None:
    if not spec:
        return None
    step, _, rank = spec.partition(":")
    return {"step": int(step), "rank": int(rank or 0)}


def run(recipe_path: str | Path, overrides: list[str] | tuple = (), *, address: str | None = None,
        max_failures: int = 0, num_workers: int | None = None, placement: str = "PACK",
        name: str | None = None, storage_path: str | None = None, temp_dir: str | None = None,
        fault: dict | None = None) -> dict:
    """Train a recipe with Ray Train; returns {"metrics", "checkpoint", "out_dir", "ray_path"}."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig
    from ray.train.torch import TorchTrainer

    recipe = load_recipe(recipe_path, overrides)
    data = _absolute_paths(recipe.to_dict(), Path.cwd())
    recipe = recipe_from_dict(data)
    out_dir = Path(recipe.train.out_dir)
    fault = fault or parse_fault(os.environ.get(FAULT_ENV))
    connect(address, temp_dir=temp_dir)
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"recipe": recipe.to_dict(), "fault": fault,
                           "run_id": f"{recipe.name}-{uuid.uuid4().hex[:12]}",
                           "plugin_paths": import_roots(recipe.loss.plugins)},
        torch_config=torch_config(recipe),
        scaling_config=scaling(recipe, num_workers, placement),
        run_config=RunConfig(
            name=name or recipe.name,
            storage_path=storage_path or str(out_dir / "ray"),
            failure_config=FailureConfig(max_failures=max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=recipe.train.keep_last),
        ),
    )
    result = trainer.fit()
    pointer = None
    if result.checkpoint is not None:
        with result.checkpoint.as_directory() as d:
            pointer = json.loads((Path(d) / POINTER).read_text())
    summary = {"name": recipe.name, "metrics": dict(result.metrics or {}), "checkpoint": pointer,
               "out_dir": str(out_dir), "ray_path": result.path}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "ray_result.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


# ---- job submission ----------------------------------------------------------------------------------

SUBMIT_EXCLUDES = [".venv", ".git", "outputs", "runs", "*.egg-info", "__pycache__", ".pytest_cache"]


def submit_excludes(recipe: str, overrides: list[str] | tuple, working_dir: str | Path) -> list[str]:
    """SUBMIT_EXCLUDES plus the recipe's data, output and local model directories that lie inside the
    uploaded working directory (anchored `/rel/path` patterns): Ray would otherwise zip and upload
    data sets and runs with the code (its working_dir limit is 500 MiB)."""

    root = Path(working_dir).resolve()
    r = load_recipe(Path(root, recipe) if not os.path.isabs(recipe) and not os.path.exists(recipe) else recipe,
                    overrides)
    out = list(SUBMIT_EXCLUDES)
    for value in (r.data.train, r.data.eval, r.eval.data, r.train.out_dir, r.model.name_or_path, r.model.tokenizer):
        if not value:
            continue
        path = Path(value) if os.path.isabs(value) else root / value
        if not (os.path.isabs(value) or path.exists() or value in (r.train.out_dir, r.data.train, r.data.eval,
                                                                    r.eval.data)):
            continue  # a hub name such as org/model
        try:
            rel = path.resolve().relative_to(root)
        except ValueError:
            continue  # outside the working directory: never uploaded
        if str(rel) != ".":
            out.append(f"/{rel.as_posix()}")
    return list(dict.fromkeys(out))


def job_entrypoint(recipe: str, overrides: list[str] | tuple = (), max_failures: int = 0,
                   num_workers: int | None = None, placement: str = "PACK", python: str = "python") -> str:
    """The command a Ray job runs on the head node (every piece shell-quoted). `python` is the head's
    interpreter with the project's packages (`python` on PATH in the container; a venv's python if not)."""
    cmd = [python, "-m", "launch.ray", recipe, *overrides,
           "--address", "auto", "--max-failures", str(max_failures), "--placement", placement]
    if num_workers:
        cmd += ["--num-workers", str(num_workers)]
    return shlex.join(cmd)


def submit_command(address: str, recipe: str, overrides: list[str] | tuple = (), **kw) -> list[str]:
    """The equivalent `ray job submit` command line (printed for the user; `submit` uses the SDK). A
    recipe that cannot be read here (it may exist only on the head) gets the fixed SUBMIT_EXCLUDES."""
    try:
        excludes = submit_excludes(recipe, overrides, REPO)
    except (FileNotFoundError, ValueError) as err:
        print(f"[launch.ray] {err}: only the fixed excludes are listed", file=sys.stderr)
        excludes = list(SUBMIT_EXCLUDES)
    return ["ray", "job", "submit", "--address", address, "--working-dir", str(REPO),
            "--runtime-env-json", json.dumps({"excludes": excludes}), "--",
            *shlex.split(job_entrypoint(recipe, overrides, **kw))]


def submit(address: str, recipe: str, overrides: list[str] | tuple = (), *, wait: bool = True,
           working_dir: str | Path = REPO, client=None, **kw) -> dict:
    """Submit the recipe as a Ray job with the project as working directory (Ray Jobs SDK), stream its
    logs, and return {"job_id", "status", "result"} where result is the job's ray_result.json.

    The job runs in Ray's copy of `working_dir` (`submit_excludes` left out): a relative recipe path is
    read from that copy, and relative paths inside the recipe (train.out_dir!) land in it too, so give
    the job absolute paths on storage the nodes share."""
    if client is None:
        from ray.job_submission import JobSubmissionClient

        client = JobSubmissionClient(address)
    entrypoint = job_entrypoint(recipe, overrides, **kw)
    excludes = submit_excludes(recipe, overrides, working_dir)
    job_id = client.submit_job(entrypoint=entrypoint,
                               runtime_env={"working_dir": str(working_dir), "excludes": excludes})
    print(f"[launch.ray] submitted {job_id}: {entrypoint}", flush=True)
    if not wait:
        return {"job_id": job_id, "status": "SUBMITTED", "result": None}
    import asyncio

    async def tail():
        async for lines in client.tail_job_logs(job_id):
            print(lines, end="", flush=True)

    try:
        asyncio.run(tail())
    except Exception as err:  # log streaming is best effort; the status below is what counts
        print(f"[launch.ray] log stream ended: {err}", flush=True)
    while (status := str(client.get_job_status(job_id))).split(".")[-1] not in ("SUCCEEDED", "FAILED", "STOPPED"):
        time.sleep(2)
    return {"job_id": job_id, "status": status.split(".")[-1], "result": result_from_logs(client.get_job_logs(job_id))}


RESULT_PREFIX = "[launch.ray] result "


def result_from_logs(logs: str) -> dict | None:
    """The last result line's JSON in a job's logs, or None. The line need not start a line of the log:
    Ray merges the driver's stdout, stderr and its workers' forwarded lines into one file without
    keeping lines whole (a forwarded line was seen glued to the front of the result under load), so
    the prefix is searched for and the JSON decoded up to its end, whatever follows it."""
    decoder = json.JSONDecoder()
    at = logs.rfind(RESULT_PREFIX)
    while at >= 0:
        try:
            return decoder.raw_decode(logs, at + len(RESULT_PREFIX))[0]
        except json.JSONDecodeError:  # cut by another writer: an earlier result line may be whole
            at = logs.rfind(RESULT_PREFIX, 0, at)
    return None


# ---- command line ------------------------------------------------------------------------------------


def _parser(submit_mode: bool) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launch.ray" + (" submit" if submit_mode else ""),
                                description=__doc__.split("\n")[0])
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*", help="key.path=value recipe overrides")
    p.add_argument("--address", default=None,
                   help=("dashboard address, http://HEAD:8265" if submit_mode else
                         "a running cluster (HEAD:6379 or auto); default: a local instance on loopback"))
    p.add_argument("--max-failures", type=int, default=0, help="group restarts allowed (-1: unlimited)")
    p.add_argument("--num-workers", type=int, default=None, help="default: nodes x GPUs per node (CPU: nodes)")
    p.add_argument("--placement", default="PACK", choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"])
    if submit_mode:
        p.add_argument("--no-wait", action="store_true")
        p.add_argument("--dry-run", action="store_true", help="print the `ray job submit` command only")
        p.add_argument("--python", default="python",
                       help="the interpreter the job runs on the head node (default: python on its PATH)")
    else:
        p.add_argument("--name", default=None, help="Ray run name (default: the recipe's name)")
        p.add_argument("--temp-dir", default=None, help=f"local instance's temp dir (default {DEFAULT_TEMP})")
        p.add_argument("--start-head", default=None, metavar="IP:PORT",
                       help="start a Ray head at IP:PORT in this process's environment, wait for "
                            "--expect-nodes nodes, run the job on it, stop the head (the SLURM template)")
        p.add_argument("--expect-nodes", type=int, default=1, help="--start-head: nodes to wait for")
        p.add_argument("--head-cpus", type=int, default=None, help="--start-head: CPUs the head offers")
        p.add_argument("--head-gpus", type=int, default=0, help="--start-head: GPUs the head offers")
        p.add_argument("--join-timeout", type=float, default=300.0,
                       help="--start-head: seconds to wait for the head and every node")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "submit":
        args = _parser(True).parse_intermixed_args(argv[1:])
        kw = dict(max_failures=args.max_failures, num_workers=args.num_workers, placement=args.placement,
                  python=args.python)
        address = args.address or os.environ.get("RAY_ADDRESS")
        if args.dry_run or not address:
            print(shlex.join(submit_command(address or "http://HEAD:8265", args.recipe, args.overrides, **kw)))
            return 0 if args.dry_run else 2
        out = submit(address, args.recipe, args.overrides, wait=not args.no_wait, **kw)
        print(json.dumps(out, default=str), flush=True)
        return 0 if out["status"] in ("SUCCEEDED", "SUBMITTED") else 1
    args = _parser(False).parse_intermixed_args(argv)
    kw = dict(max_failures=args.max_failures, num_workers=args.num_workers, placement=args.placement,
              name=args.name)
    if args.start_head:
        if args.address:
            raise SystemExit("launch.ray: give --start-head or --address, not both")
        from launch.ray_head import HeadNode

        with HeadNode(args.start_head, num_cpus=args.head_cpus or os.cpu_count(), num_gpus=args.head_gpus,
                      temp_dir=args.temp_dir) as head:
            head.wait_for_nodes(args.expect_nodes, timeout_s=args.join_timeout)
            summary = run(args.recipe, args.overrides, address=args.start_head, **kw)
    else:
        summary = run(args.recipe, args.overrides, address=args.address, temp_dir=args.temp_dir, **kw)
    # on a line of its own even when a forwarded worker line is still open (result_from_logs)
    print("\n" + RESULT_PREFIX + json.dumps(summary, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
