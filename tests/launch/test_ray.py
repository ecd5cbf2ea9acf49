"""launch.ray on a simulated 2-node Ray cluster (real Ray, gloo, DeepSpeed ZeRO-3 on CPU)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from .conftest import STEPS, env_without_host_ray, head_args_on_spare_ports

pytestmark = pytest.mark.timeout(400)


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def reference(workspace, cluster):
    from launch.ray import run

    root, recipe = workspace
    out = root / "reference"
    t0 = time.time()
    summary = run(recipe, [f"train.out_dir={out}"], name=f"reference-{time.time_ns()}")
    print(f"reference run: {time.time() - t0:.1f}s")
    return out, summary


def test_two_nodes_one_worker_each(reference):
    out, summary = reference
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    ranks = json.loads((out / "ranks.json").read_text())
    assert sorted(ranks) == ["0", "1"]
    assert ranks["0"]["node_id"] != ranks["1"]["node_id"], ranks  # PACK over two 1-CPU nodes: one each
    assert summary["metrics"]["step"] == STEPS and summary["metrics"]["loss"] == rows[-1]["loss"]
    assert summary["checkpoint"]["step"] == STEPS
    assert (out / "checkpoints" / "latest").read_text() == f"step_{STEPS:08d}"


def test_killed_worker_restarts_from_the_committed_checkpoint_with_the_same_losses(workspace, cluster, reference):
    """Rank 1 SIGKILLs itself after step 3 (checkpoints every 2 steps): Ray restarts the group, which
    resumes from step 2 and logs exactly the uninterrupted run's losses from there on."""
    from launch.ray import run

    root, recipe = workspace
    ref_out, _ = reference
    out = root / "killed"
    t0 = time.time()
    summary = run(recipe, [f"train.out_dir={out}"], name=f"killed-{time.time_ns()}", max_failures=2,
                  fault={"step": 3, "rank": 1})
    print(f"killed run: {time.time() - t0:.1f}s")
    assert (out / ".fault_injected_step3_rank1").is_file(), "the fault was never injected"
    got, want = read_metrics(out), read_metrics(ref_out)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(got, want):
        for key in ("loss", "ce", "term/smmd", "grad_norm", "lr"):
            assert a[key] == b[key], f"step {a['step']} {key}: {a[key]!r} != {b[key]!r}"
    assert summary["metrics"]["step"] == STEPS and summary["checkpoint"]["step"] == STEPS
    # the group started twice, and the same nodes held the same ranks both times
    # (by Ray node id: the simulated nodes share 127.0.0.1, so Ray's per-IP local ranks are not per node)
    starts = [{r: e["node_id"] for r, e in json.loads(line).items()}
              for line in (out / "ranks.jsonl").read_text().splitlines()]
    assert len(starts) == 2 and starts[0] == starts[1] and len(set(starts[0].values())) == 2, starts


def test_a_users_term_trains_on_ray_workers_that_load_the_recipe_themselves(workspace, cluster, tmp_path, monkeypatch):
    """loss.plugins on the simulated cluster: the plugin's folder is on the driver's sys.path only (the
    cluster's processes started without it); each worker loads the recipe it is sent, with the folder the
    driver found the plugin in on its sys.path (launch.ray), and trains the user's term with the others."""
    from launch.ray import run
    from tests.recipes import plugin_helpers as P

    root, recipe = workspace
    monkeypatch.syspath_prepend(str(P.write_package(tmp_path / "user_code")))
    out = tmp_path / "run"
    try:
        run(recipe, [f"train.out_dir={out}", "train.steps=2", f"loss.plugins=[{P.MODULE}]",
                     f"loss.objective={{terms: {{smmd: {{}}, {P.TERM}: {{}}}}}}"], name=f"plugins-{time.time_ns()}")
    finally:
        P.forget_package()
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r[f"term/{P.TERM}"] > 0
        assert r["loss"] == pytest.approx(r["ce"] + 3.0 * r["term/smmd"] + P.WEIGHT * r[f"term/{P.TERM}"], rel=1e-6)
    ranks = json.loads((out / "ranks.json").read_text())
    assert ranks["0"]["node_id"] != ranks["1"]["node_id"]


def test_submit_builds_the_ray_job_invocation(workspace, tmp_path):
    """The Ray dashboard (ray[default]) is not installed here, so no job server can run: this checks
    the `ray job submit` command and what the Jobs SDK is asked to run, through a recording client."""
    import shlex

    from launch.ray import RESULT_PREFIX, job_entrypoint, submit, submit_command

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
    from launch.ray import RESULT_PREFIX, result_from_logs

    first, last = {"metrics": {"step": 2}}, {"metrics": {"step": 3, "loss": 1.5}}
    glued = "(PlacementGroupCleaner pid=1) Found multiple active Ray instances." + RESULT_PREFIX
    assert result_from_logs("a\n" + glued + json.dumps(last) + "(Worker pid=2) tail\n") == last
    # a later result cut by another writer: the earlier whole one, not a decoding error
    logs = RESULT_PREFIX + json.dumps(first) + "\n" + RESULT_PREFIX + json.dumps(last)[:9] + "x\n"
    assert result_from_logs(logs) == first
    assert result_from_logs("training...\n") is None


def test_a_head_started_by_the_job_settles_ray_auth_for_all_its_processes(tmp_path):
    """launch.ray_head.settle_auth: the same decisions as the SLURM template (tests/launch/test_slurm.py)."""
    from launch.ray_head import settle_auth

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
    from recipes.training.runtime import free_port

    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("1" * 64)
    base = tempfile.mkdtemp(prefix="nlhd", dir="/tmp")  # short: Ray's unix sockets live under it
    env = env_without_host_ray(HOME=str(home), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0",
                               NUMLOSS_RAY_HEAD_ARGS=head_args_on_spare_ports(), PYTHONPATH=str(Path(__file__).parents[2]))
    try:
        out = subprocess.run([sys.executable, "-c", HEAD_PROBE, f"127.0.0.1:{free_port()}", os.path.join(base, "ray")],
                             env=env, capture_output=True, text=True, timeout=240)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    text = out.stdout + out.stderr
    assert out.returncode == 0 and "resources 1.0" in out.stdout, text[-4000:]
    assert "a fresh token for this job" in text and "InvalidAuthToken" not in text, text[-4000:]


def test_local_mode_trains_in_its_own_instance_without_a_line_a_second_from_the_pg_cleaner(workspace, tmp_path):
    """`python -m launch.ray RECIPE` with no address: a local instance on loopback (no dashboard), token
    auth as Ray sets it for a local instance (written to this test's HOME), 2 workers. Ray Train's
    PlacementGroupCleaner warned once a second there (no state API without a dashboard) until launch.ray
    quieted it in every worker of a local instance."""
    root, recipe = workspace
    out = tmp_path / "run"
    base = tempfile.mkdtemp(prefix="nllc", dir="/tmp")  # short: Ray's unix sockets live under it
    env = env_without_host_ray(HOME=str(tmp_path / "home"), RAY_USAGE_STATS_ENABLED="0", OMP_NUM_THREADS="1",
                               DS_ACCELERATOR="cpu")
    try:
        proc = subprocess.run([sys.executable, "-m", "launch.ray", str(recipe), f"train.out_dir={out}", "train.steps=2",
                               "--temp-dir", os.path.join(base, "ray")], env=env, cwd=Path(__file__).parents[2],
                              capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    assert "Failed to query Ray Train Controller" not in text, text[-4000:]
    assert (tmp_path / "home" / ".ray" / "auth_token").is_file()  # the local instance ran with token auth


def test_ray_places_one_worker_per_gpu_or_cpu_ranks_per_node_workers():
    from launch.ray import scaling
    from recipes.config import load_recipe

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "configs" / "demo.yaml"

    cpu = scaling(load_recipe(recipe, ["cluster.nodes=2", "cluster.gpus_per_node=0", "cluster.cpu_ranks_per_node=3",
                                       "cluster.cpus_per_worker=2"]))
    assert cpu.num_workers == 6 and not cpu.use_gpu and cpu.resources_per_worker == {"CPU": 2}
    gpu = scaling(load_recipe(recipe, ["cluster.nodes=2", "cluster.gpus_per_node=8", "cluster.cpu_ranks_per_node=3"]))
    assert gpu.num_workers == 16 and gpu.use_gpu and gpu.resources_per_worker["GPU"] == 1


def test_megatron_engine_restarts_on_ray_with_the_same_losses(workspace, cluster):
    """The Megatron engine (DP 2 over the two simulated nodes) under launch.ray: a run whose rank 1
    SIGKILLs itself after step 3 is restarted by Ray from the committed step-2 checkpoint (Megatron's
    distributed format) and logs the uninterrupted Megatron run's values."""
    from launch.ray import run

    root, recipe = workspace
    engine = "train.engine=megatron"
    want_out, out = root / "megatron", root / "megatron-killed"
    run(recipe, [f"train.out_dir={want_out}", engine], name=f"megatron-{time.time_ns()}")
    summary = run(recipe, [f"train.out_dir={out}", engine], name=f"megatron-killed-{time.time_ns()}",
                  max_failures=2, fault={"step": 3, "rank": 1})
    assert (out / ".fault_injected_step3_rank1").is_file(), "the fault was never injected"
    assert (out / "checkpoints" / f"step_{STEPS:08d}" / "megatron").is_dir()  # the engine's own state
    got, want = read_metrics(out), read_metrics(want_out)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for a, b in zip(got, want):
        for key in ("loss", "ce", "term/smmd", "grad_norm", "lr"):
            assert a[key] == b[key], f"step {a['step']} {key}: {a[key]!r} != {b[key]!r}"
    assert summary["metrics"]["step"] == STEPS
