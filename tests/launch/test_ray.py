"""launch.ray on Ray (real Ray, gloo, on CPU). Two training jobs, each restarted after a SIGKILLed worker:

- DeepSpeed ZeRO-3 on conftest's simulated 2-node cluster, with a user's term from `loss.plugins` whose
  folder only the driver has on its sys.path: the two nodes hold one worker each and the same ranks after
  the restart, and every worker (the restarted ones too) loads the plugin itself.
- Megatron (DP 2) through `python -m launch.ray` with no address: its own local instance with token auth,
  no line a second from Ray Train's PlacementGroupCleaner, Megatron's own checkpoint format restored.

Neither needs a separate uninterrupted run: the fault comes after the last step's row, so a job's first
attempt logs every row an uninterrupted run logs before it dies. The test keeps that file (a hard link;
the restarted rank 0 truncates metrics.jsonl by renaming a new file over it). The restarted group must
have resumed from the step-4 checkpoint: the rows of steps 1-4 are the first attempt's own lines (each
carries its step's measured wall time, `step_s`, which a group that trained again from step 0 would
have measured anew), and the rows of steps 5-6 are logged again, with a new wall time and exactly the
first attempt's values. Beside them: a head started by
`launch.ray` with a token file in HOME, and the job submission, result parsing, auth and placement
rules without a job.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from launch.ray import (FAULT_ENV, RESULT_PREFIX, job_entrypoint, result_from_logs, run, scaling, submit,
                        submit_command)
from launch.ray_head import settle_auth
from recipes.config import load_recipe
from recipes.training.runtime import free_port
from tests.recipes import plugin_helpers

from .conftest import STEPS, env_without_host_ray, head_args_on_spare_ports, run_in_session

pytestmark = pytest.mark.timeout(600)  # a fixture's Ray job (420 s at most) runs inside its first test's time

FAULT = {"step": STEPS, "rank": 1}  # after the last step's row; checkpoints every 2 steps: resumes from 4
RESUMED = STEPS - 2  # the committed checkpoint the restart resumes from
KEYS = ("loss", "ce", "term/smmd", "grad_norm", "lr")


def read_metrics(path: Path) -> list[dict]:
    path = path / "metrics.jsonl" if path.is_dir() else path
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class FirstAttempt:
    """Hard-links `out`/metrics.jsonl to `keep` as soon as the first attempt creates it, from a thread,
    while the job runs. The restart's truncation writes a new file over the name, so `keep` holds what the
    first attempt logged."""

    def __init__(self, out: Path, keep: Path):
        self.path, self.keep, self.done = out / "metrics.jsonl", keep, threading.Event()
        self.thread = threading.Thread(target=self._link, daemon=True)

    def _link(self) -> None:
        while not self.done.is_set():
            try:
                os.link(self.path, self.keep)
                return
            except FileNotFoundError:
                self.done.wait(0.05)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()


def assert_restart_resumed_and_logged_the_uninterrupted_values(out: Path, first: Path, extra_keys=()) -> None:
    """The first attempt logged steps 1..STEPS uninterrupted, then died. The restart rewrote metrics.jsonl
    (another file): its first RESUMED rows are the first attempt's lines byte for byte, so the restarted
    group logged none of them (a retrain from step 0 would have logged them again, each with its own
    measured `step_s`), and the rows after RESUMED were logged by the restart (a `step_s` of its own)
    with the first attempt's values: it continued from the checkpoint as the uninterrupted run did."""
    assert (out / f".fault_injected_step{FAULT['step']}_rank{FAULT['rank']}").is_file(), "the fault was never injected"
    want_lines = first.read_text().splitlines()
    got_lines = (out / "metrics.jsonl").read_text().splitlines()
    want, got = [json.loads(x) for x in want_lines], [json.loads(x) for x in got_lines]
    assert [r["step"] for r in want] == list(range(1, STEPS + 1)), "the first attempt did not reach the fault"
    assert not os.path.samefile(first, out / "metrics.jsonl"), "the restart never rewrote metrics.jsonl"
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert got_lines[:RESUMED] == want_lines[:RESUMED], "the restart logged the checkpoint's steps again"
    for a, b in zip(got[RESUMED:], want[RESUMED:]):
        assert a["step_s"] != b["step_s"], f"step {a['step']} was not logged by the restarted group"
        for key in (*KEYS, *extra_keys):
            assert a[key] == b[key], f"step {a['step']} {key}: {a[key]!r} != {b[key]!r}"


def rank_starts(out: Path) -> list[dict]:
    """Rank -> Ray node id, one map per start of the group (by node id: the simulated nodes share
    127.0.0.1, so Ray's per-IP local ranks are not per node)."""
    return [{r: e["node_id"] for r, e in json.loads(line).items()}
            for line in (out / "ranks.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def deepspeed_killed(workspace, cluster, tmp_path_factory):
    """DeepSpeed on the simulated cluster with the user's term, its rank 1 SIGKILLed after the last step.
    The plugin's folder is on the driver's sys.path only (the cluster's processes started without it)."""
    root, recipe = workspace
    out, first = root / "deepspeed", root / "deepspeed-first-attempt.jsonl"
    user_code = plugin_helpers.write_package(tmp_path_factory.mktemp("user_code"))
    t0 = time.time()
    with pytest.MonkeyPatch.context() as mp, FirstAttempt(out, first):
        mp.syspath_prepend(str(user_code))
        try:
            summary = run(recipe, [f"train.out_dir={out}", f"loss.plugins=[{plugin_helpers.MODULE}]",
                                   f"loss.objective={{terms: {{smmd: {{}}, {plugin_helpers.TERM}: {{}}}}}}"],
                          name=f"deepspeed-{time.time_ns()}", max_failures=2, fault=FAULT)
        finally:
            plugin_helpers.forget_package()
    print(f"deepspeed killed run: {time.time() - t0:.1f}s")
    return out, first, summary


def test_two_nodes_one_worker_each(deepspeed_killed):
    out, _, summary = deepspeed_killed
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    ranks = json.loads((out / "ranks.json").read_text())
    assert sorted(ranks) == ["0", "1"]
    assert ranks["0"]["node_id"] != ranks["1"]["node_id"], ranks  # PACK over two 1-CPU nodes: one each
    assert summary["metrics"]["step"] == STEPS and summary["metrics"]["loss"] == rows[-1]["loss"]
    assert summary["checkpoint"]["step"] == STEPS
    assert (out / "checkpoints" / "latest").read_text() == f"step_{STEPS:08d}"


def test_killed_worker_restarts_from_the_committed_checkpoint_with_the_same_losses(deepspeed_killed):
    """Rank 1 SIGKILLs itself after step 6 (checkpoints every 2 steps): Ray restarts the group, which
    resumes from step 4 and logs exactly the uninterrupted first attempt's values from there on."""
    out, first, summary = deepspeed_killed
    assert_restart_resumed_and_logged_the_uninterrupted_values(out, first, extra_keys=(f"term/{plugin_helpers.TERM}",))
    assert summary["metrics"]["step"] == STEPS and summary["checkpoint"]["step"] == STEPS
    # the group started twice, and the same nodes held the same ranks both times
    starts = rank_starts(out)
    assert len(starts) == 2 and starts[0] == starts[1] and len(set(starts[0].values())) == 2, starts


def test_a_users_term_trains_on_ray_workers_that_load_the_recipe_themselves(deepspeed_killed):
    """loss.plugins on the simulated cluster: the plugin's folder is on the driver's sys.path only; each
    worker, the restarted ones too, loads the recipe it is sent, with the folder the driver found the
    plugin in on its sys.path (launch.ray), and trains the user's term with the others."""
    out, _, _ = deepspeed_killed
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert r[f"term/{plugin_helpers.TERM}"] > 0
        user_term = plugin_helpers.WEIGHT * r[f"term/{plugin_helpers.TERM}"]
        assert r["loss"] == pytest.approx(r["ce"] + 3.0 * r["term/smmd"] + user_term, rel=1e-6)


def test_submit_builds_the_ray_job_invocation(workspace, tmp_path):
    """The Ray dashboard (ray[default]) is not installed here, so no job server can run: this checks
    the `ray job submit` command and what the Jobs SDK is asked to run, through a recording client."""
    _, recipe = workspace
    cmd = submit_command("http://head:8265", "recipes/x y.yaml", ["train.steps=3", "name=a;rm -rf /"],
                         max_failures=2)
    assert cmd[:6] == ["ray", "job", "submit", "--address", "http://head:8265", "--working-dir"]
    rest = cmd[cmd.index("--") + 1:]
    assert rest[:4] == ["python", "-m", "launch.ray", "recipes/x y.yaml"]
    assert "name=a;rm -rf /" in rest and rest[rest.index("--max-failures") + 1] == "2"
    assert shlex.split(job_entrypoint("r.yaml", ["a=$(x)"])) [3:5] == ["r.yaml", "a=$(x)"]

    class Client:  # records what the SDK would be asked; answers like a finished job
        def submit_job(self, entrypoint, runtime_env):
            self.entrypoint, self.runtime_env = entrypoint, runtime_env
            return "raysubmit_1"

        async def tail_job_logs(self, job_id):
            yield "training...\n"

        def get_job_status(self, job_id):
            return "JobStatus.SUCCEEDED"

        def get_job_logs(self, job_id):
            return "x\n" + RESULT_PREFIX + json.dumps({"metrics": {"step": 3, "loss": 1.5}}) + "\n"

    client = Client()
    out = submit("http://head:8265", str(recipe), ["train.steps=3"], client=client, working_dir=tmp_path)
    assert out == {"job_id": "raysubmit_1", "status": "SUCCEEDED", "result": {"metrics": {"step": 3, "loss": 1.5}}}
    assert client.runtime_env["working_dir"] == str(tmp_path) and ".venv" in client.runtime_env["excludes"]
    assert shlex.split(client.entrypoint)[:4] == ["python", "-m", "launch.ray", str(recipe)]


def test_the_result_is_found_where_ray_glued_another_line_to_it():
    """Ray's job log merges the driver's streams and its workers' forwarded lines without keeping lines
    whole; a forwarded line once ended where the result began (seen in a loaded suite run)."""
    first, last = {"metrics": {"step": 2}}, {"metrics": {"step": 3, "loss": 1.5}}
    glued = "(PlacementGroupCleaner pid=1) Found multiple active Ray instances." + RESULT_PREFIX
    assert result_from_logs("a\n" + glued + json.dumps(last) + "(Worker pid=2) tail\n") == last
    # a later result cut by another writer: the earlier whole one, not a decoding error
    logs = RESULT_PREFIX + json.dumps(first) + "\n" + RESULT_PREFIX + json.dumps(last)[:9] + "x\n"
    assert result_from_logs(logs) == first
    assert result_from_logs("training...\n") is None


def test_a_head_started_by_the_job_settles_ray_auth_for_all_its_processes(tmp_path):
    """launch.ray_head.settle_auth: the same decisions as the SLURM template (tests/launch/test_slurm.py)."""
    env = {}
    assert "fresh token" in settle_auth(env)
    token = env["RAY_AUTH_TOKEN"]
    assert env["RAY_AUTH_MODE"] == "token" and len(token) == 64 and int(token, 16) >= 0
    assert "from RAY_AUTH_TOKEN" in settle_auth(env) and env["RAY_AUTH_TOKEN"] == token  # settled once: kept
    assert settle_auth(off := {"RAY_AUTH_MODE": "disabled"}) and off == {"RAY_AUTH_MODE": "disabled"}
    (tmp_path / "t").write_text("abc\n")
    assert settle_auth(given := {"RAY_AUTH_TOKEN_PATH": str(tmp_path / "t")}).endswith(str(tmp_path / "t"))
    assert given == {"RAY_AUTH_TOKEN_PATH": str(tmp_path / "t"), "RAY_AUTH_MODE": "token"}  # no second token
    (tmp_path / "empty").write_text("")
    for missing in (tmp_path / "empty", tmp_path / "none"):
        with pytest.raises(ValueError, match=f"RAY_AUTH_TOKEN_PATH={missing}: no such file, or it is empty"):
            settle_auth({"RAY_AUTH_TOKEN_PATH": str(missing)})


HEAD_PROBE = """
import ray, sys
from launch.ray_head import HeadNode
with HeadNode(sys.argv[1], num_cpus=1, num_gpus=0, temp_dir=sys.argv[2]) as head:
    head.wait_for_nodes(1, timeout_s=90)
    print("resources", ray.cluster_resources().get("CPU"))
"""


def test_a_head_started_outside_slurm_takes_its_own_driver_where_a_token_file_exists(tmp_path):
    """`launch.ray --start-head` run by hand on a host whose ~/.ray/auth_token exists, no RAY_AUTH_* set:
    its driver (this process, which imported ray before settling) joins the head it started."""
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("1" * 64)
    base = tempfile.mkdtemp(prefix="nlhd", dir="/tmp")  # short: Ray's unix sockets live under it
    env = env_without_host_ray(HOME=str(home), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0",
                               NUMLOSS_RAY_HEAD_ARGS=head_args_on_spare_ports(), PYTHONPATH=str(Path(__file__).parents[2]))
    try:
        out = run_in_session([sys.executable, "-c", HEAD_PROBE, f"127.0.0.1:{free_port()}", os.path.join(base, "ray")],
                             env=env, log=tmp_path / "head_probe.log", timeout=240)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    text = out.stdout + out.stderr
    assert out.returncode == 0 and "resources 1.0" in out.stdout, text[-4000:]
    assert "a fresh token for this job" in text and "InvalidAuthToken" not in text, text[-4000:]


@pytest.fixture(scope="module")
def megatron_local(workspace, tmp_path_factory):
    """`python -m launch.ray RECIPE` with no address, Megatron, its rank 1 SIGKILLed after the last step
    (NUMLOSS_FAULT), --max-failures 2: a local instance on loopback (no dashboard), token auth as Ray
    sets it for a local instance (written to this run's HOME), 2 workers, started twice."""
    root, recipe = workspace
    tmp = tmp_path_factory.mktemp("local")
    out, first, home = tmp / "run", tmp / "first-attempt.jsonl", tmp / "home"
    base = tempfile.mkdtemp(prefix="nllc", dir="/tmp")  # short: Ray's unix sockets live under it
    env = env_without_host_ray(HOME=str(home), RAY_USAGE_STATS_ENABLED="0", OMP_NUM_THREADS="1",
                               DS_ACCELERATOR="cpu", **{FAULT_ENV: f"{FAULT['step']}:{FAULT['rank']}"})
    try:
        with FirstAttempt(out, first):
            proc = run_in_session([sys.executable, "-m", "launch.ray", str(recipe), f"train.out_dir={out}",
                                   "train.engine=megatron", "--max-failures", "2",
                                   "--temp-dir", os.path.join(base, "ray")],
                                  env=env, log=tmp / "launch_ray.log",
                                  timeout=420)  # 72 s idle, 144 s in the suite, ~210 s beside two more such jobs
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return proc, out, first, home


def test_local_mode_trains_in_its_own_instance_without_a_line_a_second_from_the_pg_cleaner(megatron_local):
    """Ray Train's PlacementGroupCleaner warned once a second in a local instance (no state API without
    a dashboard) until launch.ray quieted it in every worker of a local instance (the restarted ones too)."""
    proc, out, _, home = megatron_local
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert [r["step"] for r in read_metrics(out)] == list(range(1, STEPS + 1))
    assert result_from_logs(proc.stdout)["metrics"]["step"] == STEPS
    assert "Failed to query Ray Train Controller" not in text, text[-4000:]
    assert (home / ".ray" / "auth_token").is_file()  # the local instance ran with token auth


def test_ray_places_one_worker_per_gpu_or_cpu_ranks_per_node_workers():
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "configs" / "demo.yaml"

    cpu = scaling(load_recipe(recipe, ["cluster.nodes=2", "cluster.gpus_per_node=0", "cluster.cpu_ranks_per_node=3",
                                       "cluster.cpus_per_worker=2"]))
    assert cpu.num_workers == 6 and not cpu.use_gpu and cpu.resources_per_worker == {"CPU": 2}
    gpu = scaling(load_recipe(recipe, ["cluster.nodes=2", "cluster.gpus_per_node=8", "cluster.cpu_ranks_per_node=3"]))
    assert gpu.num_workers == 16 and gpu.use_gpu and gpu.resources_per_worker["GPU"] == 1


def test_megatron_engine_restarts_on_ray_with_the_same_losses(megatron_local):
    """The Megatron engine (DP 2) under launch.ray: rank 1 SIGKILLs itself after step 6, Ray restarts the
    group from the committed step-4 checkpoint (Megatron's distributed format), which logs the
    uninterrupted first attempt's values."""
    proc, out, first, _ = megatron_local
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    # printed by recipes.train once the engine loaded the checkpoint, with the step its state was saved at
    # (Ray's log forwarding may repeat a worker's line: one rank 0 said it, once per start that resumed)
    resumed = {line.split("pid=", 1)[1].split(")", 1)[0] for line in text.splitlines()
               if f"[numloss] resumed tiny from step {RESUMED}" in line and "pid=" in line}
    assert len(resumed) == 1 and "[numloss] resumed tiny from step" not in text.replace(
        f"[numloss] resumed tiny from step {RESUMED}", ""), text[-4000:]
    assert (out / "checkpoints" / f"step_{STEPS:08d}" / "megatron").is_dir()  # the engine's own state
    assert_restart_resumed_and_logged_the_uninterrupted_values(out, first)
    starts = rank_starts(out)
    assert len(starts) == 2 and starts[0] == starts[1], starts
