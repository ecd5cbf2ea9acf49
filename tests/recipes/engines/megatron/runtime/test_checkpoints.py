"""The Megatron engine's checkpoint writers' helper process lives exactly as long as its rank
(recipes/engines/megatron/runtime/checkpoints.py writer_queue_dies_with_rank, recipes.training.runtime.die_with_parent).

A real process: a 1-rank gloo world saves a sharded tensor with megatron-core's dist_checkpointing, which
starts the manager that serves its writers' queue; the process is then SIGKILLed alone, as torchrun's
shutdown timeout or the OOM killer does. With megatron-core's own queue the manager's server outlives it;
with the engine's, the kernel ends it with the rank, and the stop signals the rank answers by saving
(torchrun and SLURM send them to its whole process group) leave it serving that save."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recipes.training.runtime import free_port

pytest.importorskip("megatron.core")

pytestmark = pytest.mark.timeout(300)  # the reads of the rank's output below block until a line comes

REPO = Path(__file__).resolve().parents[5]

RANK = """
import os, sys, time
import torch, torch.distributed as dist
out, queue_owner = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
from recipes.engines.megatron.runtime import cpu_shim
cpu_shim.apply()  # as the engine runs megatron-core on CPU (torch.cuda.synchronize in its writer's staging)
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.strategies import filesystem_async
from recipes.engines.megatron.runtime.checkpoints import writer_queue_dies_with_rank
if queue_owner == "engine":
    writer_queue_dies_with_rank()
    made = filesystem_async._results_queue
dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(6.0))}, out)
if queue_owner == "engine":
    assert filesystem_async._results_queue is made, "the save made its own queue"
loaded = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(6))}, out)
assert torch.equal(loaded["w"], torch.arange(6.0)), loaded
print("SERVER", filesystem_async._results_queue._manager._process.pid, flush=True)
if sys.stdin.readline():
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(6.0))}, out + "/again")
    print("SAVED AGAIN", flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _server_after_rank_is_killed(tmp_path: Path, queue_owner: str, stop_signals: tuple = ()) -> bool:
    """Save, send the writers' manager server `stop_signals` (it must still serve: checked by the rank's
    second save), SIGKILL the rank alone, and say whether the server is alive 5 s later."""
    (tmp_path / "ckpt").mkdir()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    (tmp_path / "ckpt" / "again").mkdir()
    proc = subprocess.Popen([sys.executable, "-c", RANK, str(tmp_path / "ckpt"), queue_owner], cwd=tmp_path, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        server, lines, deadline = None, [], time.time() + 180
        while server is None:
            line = proc.stdout.readline()
            if not line or time.time() > deadline:
                pytest.fail(f"the rank ended or stalled before its save was done:\n{''.join(lines)[-4000:]}")
            lines.append(line)
            if line.startswith("SERVER "):
                server = int(line.split()[1])
        assert _alive(server)
        for sig in stop_signals:  # as torchrun's SIGTERM to the rank's process group reaches it
            os.kill(server, sig)
        if stop_signals:
            proc.stdin.write("save again\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
            assert line.startswith("SAVED AGAIN"), (line + proc.stdout.read())[-4000:]  # a failed save ends it
        proc.send_signal(signal.SIGKILL)  # the rank alone, not its process group
        proc.wait(timeout=30)
        deadline = time.time() + 5
        while _alive(server) and time.time() < deadline:
            time.sleep(0.1)
        return _alive(server)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # what the rank left, whichever case
        except ProcessLookupError:
            pass
        proc.wait()


def test_megatron_cores_own_writer_manager_outlives_a_sigkilled_rank(tmp_path):
    """The case the engine's queue exists for: without it, the server stays (were this false, the
    next test could pass for the wrong reason)."""
    assert _server_after_rank_is_killed(tmp_path, "megatron-core")


def test_the_engines_writer_manager_outlives_stop_requests_and_ends_with_a_sigkilled_rank(tmp_path):
    """SIGTERM and SIGUSR1 (the rank's own stop requests, which it answers by saving) leave the server
    serving the next save; the rank's SIGKILL ends it."""
    assert not _server_after_rank_is_killed(tmp_path, "engine", (signal.SIGTERM, signal.SIGUSR1))
