"""The rendered Ray batch script runs end to end under a fake SLURM whose container steps do not share
/tmp (tests/launch/fake_slurm.py: each `srun --container-image` step gets its own mount namespace with
a private tmpfs on /tmp, as pyxis/enroot containers do).

Before the fix the head, the wait-for-nodes step and the driver were three steps: the driver could not
reach the head's raylet sockets under the head container's /tmp/ray, and the job never trained. The job
runs with a HOME that holds ~/.ray/auth_token: before the script settled Ray's token auth for every
step, its head turned token auth on from that file and refused its own driver ("InvalidAuthToken").

Not simulated here (no CPU test reaches them): several real hosts (every "node" is this host, so the
job runs on one Ray node; worker nodes joining over TCP are covered by tests/launch/test_ray.py's
simulated cluster), a real image, cgroup limits, NCCL.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from recipes.training.runtime import free_port

from . import fake_slurm
from .conftest import head_args_on_spare_ports, tiny_recipe

pytestmark = [pytest.mark.timeout(400),
              pytest.mark.skipif(not fake_slurm.private_tmp_available(),
                                 reason="needs unprivileged user + mount namespaces (unshare -rm)")]


@pytest.fixture
def workspace():
    """Outside /tmp: the steps' private /tmp would hide it (on a cluster: shared storage)."""
    from data_prep.sources.base import SourceConfig
    from recipes.experiments.tiny import build_plain_shards

    root = Path(tempfile.mkdtemp(prefix="numloss-slurm-", dir="/var/tmp"))
    try:
        recipe = tiny_recipe(root, steps=2, save_every=0)
        build_plain_shards(SourceConfig(kind="arithmetic", options={"module": "add_or_sub", "n": 32,
                                                                    "max_digits": 2, "negatives": False}),
                           root / "tok", root / "data", max_length=32)
        recipe["train"]["out_dir"] = str(root / "run")
        recipe["cluster"] = {"nodes": 1, "gpus_per_node": 0, "cpu_ranks_per_node": 2, "cpus_per_worker": 1,
                             "container": "numloss:test"}
        path = root / "recipe.yaml"
        path.write_text(yaml.safe_dump(recipe))
        yield root, path
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_ray_job_runs_when_every_container_step_has_its_own_tmp(workspace):
    from launch.slurm import render

    root, recipe = workspace
    repo = Path(__file__).resolve().parents[2]
    port = free_port()
    script = root / "job.sbatch"
    script.write_text(render(recipe, "ray", port=port, workdir=str(repo)))
    script.chmod(0o755)
    log = root / "srun.jsonl"
    bin_dir = fake_slurm.install(root / "bin")
    # a home that holds ~/.ray/auth_token, as any host that once ran a local ray.init() does: `ray start
    # --head` alone then turns token auth on, and the job's driver was refused by its own head
    home = root / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("0" * 64)
    env = fake_slurm.env(bin_dir, log, ["node1"], SLURM_SUBMIT_DIR=str(repo), OMP_NUM_THREADS="1",
                         NUMLOSS_RAY_HEAD_ARGS=head_args_on_spare_ports(),
                         RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", HOME=str(home))
    # its own session: on a timeout the whole job (the head step's Ray processes included) is ended
    proc = subprocess.Popen(["bash", str(script)], env=env, cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=360)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        output, _ = proc.communicate(timeout=90)
        pytest.fail(f"the job did not finish in 360 s:\n{output[-6000:]}")
    assert proc.returncode == 0, output[-6000:]
    assert "auth: a fresh token for this job" in output and "InvalidAuthToken" not in output, output[-6000:]
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    container_steps = [s for s in steps if "--container-image" in s["options"]]
    # one container step on the head node holds head, wait and driver
    assert len(container_steps) == 1, steps
    assert "--start-head" in container_steps[0]["command"]
    rows = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert (root / "run" / "checkpoints" / "latest").read_text() == "step_00000002"
