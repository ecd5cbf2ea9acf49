"""`python -m launch.ray submit` for real: a local Ray head with its dashboard (the Jobs API, ray[default])
on loopback in its own temp dir, started here with `ray start --head --block` and ended by signalling only
the processes this test started (never `ray stop`). The tiny recipe goes up as a Ray job with the project
as working directory, trains 3 steps on 1 worker, and the metrics `submit` returns are the last row of
the job's metrics.jsonl. The head runs with token authentication (RAY_AUTH_MODE=token and its own
token, whatever this host's ~/.ray/auth_token holds; Ray's default for every cluster from 2.61): the
submitter sends the token, and the job's driver, started by the cluster, connects with the token it
inherits."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import pytest

pytest.importorskip("ray.dashboard")
pytest.importorskip("aiohttp")  # the dashboard's server: installed by ray[default], not ray[train]

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[2]
STEPS = 3


def free_ports(n: int) -> list[int]:
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


@pytest.fixture(scope="module")
def head():
    """A single-node Ray head with the dashboard on 127.0.0.1; yields the dashboard's http address."""
    ray_cli = Path(sys.executable).parent / "ray"
    if not ray_cli.is_file():
        pytest.skip(f"no ray CLI next to {sys.executable}")
    (gcs, dash, client, agent_http, agent_grpc, runtime_env, metrics, node_manager, object_manager) = free_ports(9)
    base = tempfile.mkdtemp(prefix="nlsub", dir="/tmp")  # short: Ray's unix sockets live under it
    temp = os.path.join(base, "ray")
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # stay on loopback (launch.ray.LOOPBACK_ENV)
           "RAY_TMPDIR": base, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",  # SIGTERM: stop at once, no drain wait
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    auth = {"Authorization": f"Bearer {env['RAY_AUTH_TOKEN']}"}
    cmd = [str(ray_cli), "start", "--head", "--block", "--disable-usage-stats",
           "--node-ip-address", "127.0.0.1", "--port", str(gcs), "--temp-dir", temp,
           "--num-cpus", "2", "--num-gpus", "0",
           "--include-dashboard", "true", "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash),
           "--ray-client-server-port", str(client), "--dashboard-agent-listen-port", str(agent_http),
           "--dashboard-agent-grpc-port", str(agent_grpc), "--runtime-env-agent-port", str(runtime_env),
           "--metrics-export-port", str(metrics), "--node-manager-port", str(node_manager),
           "--object-manager-port", str(object_manager)]
    log = open(os.path.join(base, "ray_start.log"), "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    try:
        t0 = time.time()
        while True:  # the Jobs API answers once the dashboard is up
            if proc.poll() is not None:
                pytest.fail(f"ray start exited {proc.returncode}:\n{Path(log.name).read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(urllib.request.Request(address + "/api/jobs/", headers=auth),
                                            timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() - t0 > 90:
                pytest.fail(f"no dashboard at {address} after 90 s:\n{Path(log.name).read_text()[-4000:]}")
            time.sleep(0.5)
        print(f"ray head with dashboard up in {time.time() - t0:.1f}s at {address}")
        with pytest.raises(urllib.error.HTTPError) as refused:  # token auth is on: no token, no answer
            urllib.request.urlopen(address + "/api/jobs/", timeout=5)
        assert refused.value.code in (401, 403), refused.value
        yield address, Path(temp), auth
    finally:
        # ray start --block shuts its node down on SIGTERM; then anything left in the session it led
        # (started by this test only) is killed. Never `ray stop`: it would end every Ray on the host.
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        log.close()
        shutil.rmtree(base, ignore_errors=True)


def test_submit_runs_the_recipe_as_a_ray_job(head, workspace, capsys):
    address, temp, auth = head
    from ray.job_submission import JobSubmissionClient

    from launch.ray import RESULT_PREFIX, submit

    root, recipe = workspace
    out = root / f"submitted-{time.time_ns()}"
    t0 = time.time()
    # the job runs from Ray's copy of the project (SUBMIT_EXCLUDES left out) with this venv's python;
    # the recipe's paths are absolute (tmp), as a job's must be
    client = JobSubmissionClient(address, headers=auth)
    summary = submit(address, str(recipe), [f"train.out_dir={out}", f"train.steps={STEPS}", "cluster.nodes=1"],
                     working_dir=REPO, python=sys.executable, client=client)
    elapsed = time.time() - t0
    streamed = capsys.readouterr().out
    print(f"submitted job: {elapsed:.1f}s")

    logs = client.get_job_logs(summary["job_id"])
    assert summary["status"] == "SUCCEEDED", logs[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    result = summary["result"]
    assert result is not None, logs[-4000:]
    assert {k: result["metrics"][k] for k in rows[-1]} == rows[-1]
    assert result["checkpoint"]["step"] == STEPS and result["out_dir"] == str(out)
    assert json.loads((out / "ray_result.json").read_text())["metrics"] == result["metrics"]
    # logs: streamed while the job ran, and kept by the job server
    assert f"[launch.ray] submitted {summary['job_id']}" in streamed
    assert RESULT_PREFIX in streamed and RESULT_PREFIX in logs
    # the job ran from Ray's unpacked copy of the project, which holds none of the excluded folders
    uri = client.get_job_info(summary["job_id"]).runtime_env["working_dir"]
    assert uri.startswith("gcs://_ray_pkg_"), uri
    copies = {c.resolve() for c in temp.glob("session_*/runtime_resources/working_dir_files/_ray_pkg_*")
              if c.is_dir()}
    assert copies and all((c / "launch" / "ray.py").is_file() for c in copies), copies
    for c in copies:
        assert not [x for x in (".venv", ".git", "outputs", "runs") if (c / x).exists()], sorted(os.listdir(c))
