"""Shared set-up for the launch tests: tiny data and recipe (built with recipes.experiments.tiny, like tests/recipes/test_train.py)
and one simulated 2-node Ray cluster (ray.cluster_utils.Cluster) on loopback in its own temp dir, shared
by every test in the session (starting one costs seconds; `ray stop` is never used)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import yaml

# Ray turns 127.0.0.1 into the host's address unless it is told this is not a multi-host cluster; set
# before ray is imported (the raylets and workers inherit it). See launch.ray.LOOPBACK_ENV.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
pytest.importorskip("ray")
pytest.importorskip("deepspeed")

STEPS = 6


def head_args_on_spare_ports() -> str:
    """NUMLOSS_RAY_HEAD_ARGS for a head started by a test: no dashboard, and the head's fixed default ports
    (client server, dashboard agent, metrics, runtime env agent) moved to free ones, out of the way of
    other Ray instances on this host."""
    from recipes.training.runtime import free_port

    ports = " ".join(f"--{k}={free_port()}" for k in (
        "ray-client-server-port", "dashboard-agent-listen-port", "metrics-export-port", "runtime-env-agent-port",
        "dashboard-agent-grpc-port"))
    return f"--include-dashboard=false {ports}"


def env_without_host_ray(**extra: str) -> dict:
    """This process's environment without this host's Ray address, auth and temp dir, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH", "RAY_TMPDIR"))}
    return {**env, **extra}


def run_in_session(cmd: list[str], *, env: dict, log: Path, timeout: float,
                   cwd: Path = Path(__file__).resolve().parents[2]) -> subprocess.CompletedProcess:
    """Run `cmd` in a session of its own, stdout and stderr to `log` (returned as `stdout`). Past
    `timeout` the whole session is killed, the driver and what it started (a local Ray instance's
    daemons and workers: nothing outlives the test), and the test fails with the output's tail, which
    says where the run stood."""
    t0 = time.time()
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=sink, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    text = Path(log).read_text(errors="replace")
    if returncode is None:
        pytest.fail(f"{' '.join(cmd[:4])} ... still running after {time.time() - t0:.0f} s (killed); "
                    f"its output ends:\n{text[-6000:]}")
    return subprocess.CompletedProcess(cmd, returncode, stdout=text, stderr="")


def tiny_recipe(root: Path, steps: int = STEPS, **train) -> dict:
    from recipes.experiments.tiny import tiny_llama_config, train_tokenizer

    tok = train_tokenizer(["Calculate 0123456789 + - * / = . ( )"], root / "tok", "digits")
    return {
        "name": "tiny",
        "model": {"config": tiny_llama_config(len(tok), hidden=32, layers=1, heads=2, kv_heads=1),
                  "tokenizer": str(root / "tok"), "dtype": "float32"},
        "data": {"train": str(root / "data")},
        "loss": {"objective": {"terms": {"smmd": {}}}},
        "optim": {"lr": 3e-3, "warmup_steps": 1},
        "train": {"steps": steps, "micro_batch_size": 4, "grad_accum": 1, "save_every": 2, "keep_last": 2,
                  "progress": False, "tensorboard": False, "export": False, **train},
        "cluster": {"nodes": 2, "gpus_per_node": 0, "cpus_per_worker": 1},
    }


@pytest.fixture(scope="session")
def workspace(tmp_path_factory):
    from data_prep.sources.base import SourceConfig
    from recipes.experiments.tiny import build_plain_shards

    root = tmp_path_factory.mktemp("launch")
    recipe = tiny_recipe(root)
    build_plain_shards(SourceConfig(kind="arithmetic", options={"module": "add_or_sub", "n": 96, "max_digits": 2,
                                                                "negatives": False}),
                       root / "tok", root / "data", max_length=32)
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return root, path


@pytest.fixture(scope="package")
def cluster():
    """Two simulated nodes with one CPU each: a 2-worker PACK placement must use both. Package-scoped:
    the cluster's daemons (GCS, raylets, log monitor) stop after this folder's tests instead of idling
    beside the rest of the suite."""
    import ray
    from ray.cluster_utils import Cluster

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    base = tempfile.mkdtemp(prefix="nlray", dir="/tmp")  # short: Ray's unix sockets live under it
    temp = os.path.join(base, "ray")
    os.makedirs(temp)
    os.environ["RAY_TMPDIR"] = base  # Cluster also writes its address file there, not in /tmp/ray
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "node_ip_address": "127.0.0.1", "temp_dir": temp, "include_dashboard": False})
    c.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    ray.init(address=c.address, log_to_driver=True)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        shutil.rmtree(base, ignore_errors=True)
