"""A Ray head started inside the job's own process, for `python -m launch.ray --start-head` (the SLURM
template): see `HeadNode`."""

from __future__ import annotations

import os
import secrets
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import ray

HEAD_ARGS_ENV = "NUMLOSS_RAY_HEAD_ARGS"  # extra `ray start --head` options, e.g. ports on a shared host
AUTH_MODE_ENV, AUTH_TOKEN_ENV, AUTH_TOKEN_PATH_ENV = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"


def settle_auth(environ) -> str:
    """Decide Ray's token authentication once for every process of the job; returns a line for the log
    (never the token).

    Ray (2.59+) decides it per process when RAY_AUTH_MODE is unset: `ray start --head` turns token auth
    on where ~/.ray/auth_token exists (any local `ray.init()` writes that file), while a driver's
    `ray.init(address=...)` and a joining `ray start --address` follow RAY_AUTH_MODE only. On a host that
    once ran a local Ray, the job's own driver was then refused by its own head ("InvalidAuthToken").
    So the job settles it in `environ`, which the head (a child), this driver and, through srun, the
    other nodes inherit (the SLURM template does the same in its batch shell, before any step):
    - RAY_AUTH_MODE given: kept (`disabled` opts out);
    - otherwise `token`, with RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH when given, else a fresh token for
      this job in RAY_AUTH_TOKEN (not ~/.ray/auth_token: the other nodes' homes may not hold it).
    ValueError when RAY_AUTH_TOKEN_PATH names a missing or empty file (Ray would abort each process on it).
    """
    mode = environ.setdefault(AUTH_MODE_ENV, "token")
    if mode != "token":
        return f"Ray token auth: {mode} ({AUTH_MODE_ENV})"
    if environ.get(AUTH_TOKEN_ENV):
        return f"Ray token auth: token from {AUTH_TOKEN_ENV}"
    path = environ.get(AUTH_TOKEN_PATH_ENV)
    if path:
        if not Path(path).is_file() or not Path(path).read_text().strip():
            raise ValueError(f"{AUTH_TOKEN_PATH_ENV}={path}: no such file, or it is empty (the Ray token)")
        return f"Ray token auth: token from {AUTH_TOKEN_PATH_ENV}={path}"
    environ[AUTH_TOKEN_ENV] = secrets.token_hex(32)
    return "Ray token auth: a fresh token for this job (other nodes need this RAY_AUTH_TOKEN to join)"


def ray_cli() -> list[str]:
    """The `ray` command of this interpreter's environment (its script beside python, else the module)."""
    script = Path(sys.executable).with_name("ray")
    return [str(script)] if script.exists() else [sys.executable, "-m", "ray.scripts.scripts"]


class HeadNode:
    """A Ray head started in *this* process's environment (`ray start --head --block` as a child), for
    the SLURM template: under pyxis/enroot every `srun` step is its own container with a private /tmp,
    and Ray's driver must reach its node's raylet through the unix sockets under the head's temp dir, so
    the head and the driver have to live in one step. On exit the child is sent SIGTERM (`ray start
    --block` then stops this node only; never `ray stop`, which ends every Ray process on the host).
    Token authentication is settled in this process's environment first (`settle_auth`), so the head,
    this driver and the Ray workers agree on it.

        with HeadNode("10.0.0.1:6379", num_cpus=96, num_gpus=8) as head:
            head.wait_for_nodes(4, timeout_s=300)
            run(...)
    """

    def __init__(self, address: str, num_cpus: int, num_gpus: int, temp_dir: str | None = None):
        ip, _, port = address.rpartition(":")
        if not ip or not port.isdigit():
            raise ValueError(f"--start-head: expected IP:PORT, got {address!r}")
        self.address = address
        cmd = [*ray_cli(), "start", "--head", f"--node-ip-address={ip}", f"--port={port}",
               f"--num-cpus={num_cpus}", f"--num-gpus={num_gpus}", "--block"]
        if temp_dir:
            cmd.append(f"--temp-dir={temp_dir}")
        # extra `ray start --head` options, e.g. other ports where another Ray already uses the defaults
        cmd += shlex.split(os.environ.get(HEAD_ARGS_ENV, ""))
        print(f"[launch.ray] {settle_auth(os.environ)}", flush=True)
        # this process reads RAY_* settings once and caches them (as Ray itself does when it turns token
        # auth on, re-read them now that the mode and token may have changed)
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
        print(f"[launch.ray] starting the Ray head: {shlex.join(cmd)}", flush=True)
        self.proc = subprocess.Popen(cmd)

    def wait_for_nodes(self, nodes: int, timeout_s: float = 300.0) -> int:
        """Connect this driver to the head, then wait until `nodes` Ray nodes are alive (RuntimeError
        after `timeout_s`, or at once if the head process died)."""
        deadline = time.monotonic() + timeout_s
        while not ray.is_initialized():
            self._check_alive()
            try:
                ray.init(address=self.address, log_to_driver=True)
            except (ConnectionError, RuntimeError) as err:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the Ray head at {self.address} did not come up in {timeout_s:g}s: "
                                       f"{err}") from None
                time.sleep(2)
        alive = 0
        while time.monotonic() < deadline:
            self._check_alive()
            alive = sum(1 for n in ray.nodes() if n["Alive"])
            if alive >= nodes:
                print(f"[launch.ray] {alive} Ray nodes up", flush=True)
                return alive
            time.sleep(1)
        raise RuntimeError(f"only {alive} of {nodes} Ray nodes joined {self.address} within {timeout_s:g}s "
                           f"(a node joins only with this job's {AUTH_MODE_ENV} and token in its environment)")

    def _check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the Ray head process exited with status {self.proc.returncode}")

    def __enter__(self) -> "HeadNode":
        return self

    def __exit__(self, *exc) -> None:
        if ray.is_initialized():
            ray.shutdown()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except Exception:  # noqa: BLE001  (TimeoutExpired): it would not stop, so end it
                self.proc.kill()
                self.proc.wait(timeout=30)
