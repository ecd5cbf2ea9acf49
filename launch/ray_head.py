"""A Ray head started inside the job's own process, for `python -m launch.ray --start-head` (the SLURM
template): see `HeadNode`."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import ray

HEAD_ARGS_ENV = "NUMLOSS_RAY_HEAD_ARGS"  # extra `ray start --head` options, e.g. ports on a shared host


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
        raise RuntimeError(f"only {alive} of {nodes} Ray nodes joined {self.address} within {timeout_s:g}s")

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
