"""A fake `srun` and `scontrol` for running rendered batch scripts on one machine.

What it simulates: every `srun` step that carries `--container-image` (pyxis/enroot) runs in its own
mount namespace (`unshare -rm`) with a private tmpfs on /tmp, as each pyxis container has its own
/tmp; its working directory is `--container-workdir`. Each call is logged (one JSON line per step:
options and command) to $FAKE_SLURM_LOG so tests can check the flags every step gets.

What it does not: real nodes (every "node" is this host), cgroups (`--cpus-per-task`, `--mem` are only
logged), a container image (the host's Python runs), `--kill-on-bad-exit` (logged, not enforced).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

SRUN = r'''#!{python}
import json, os, sys
VALUED_SHORT = {{"-w", "-N", "-n", "-c", "-J", "-t", "-p"}}
argv = sys.argv[1:]
options, i = {{}}, 0
while i < len(argv) and argv[i].startswith("-"):
    a = argv[i]
    if a in VALUED_SHORT:
        options[a] = argv[i + 1]; i += 2; continue
    key, eq, value = a.partition("=")
    options[key] = value if eq else True
    i += 1
command = argv[i:]
ENV = ("HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "MOUNTS",
       "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "PYTHONPATH")
with open(os.environ["FAKE_SLURM_LOG"], "a") as log:
    log.write(json.dumps({{"options": options, "command": command,
                          "env": {{k: os.environ[k] for k in ENV if k in os.environ}}}}) + "\n")
if not command:
    sys.exit("fake srun: no command")
if os.environ.get("FAKE_SRUN_DRY") == "1" and command[0] != "hostname":
    hold = os.environ.get("FAKE_SRUN_DRY_HOLD")
    if hold and "--start-head" in command:
        # a dry head step that ended at once would have the script stop the node steps it starts next
        # (and a node step killed before it logs is not seen): hold until a step running `hold` has logged
        import time
        deadline = time.monotonic() + 60
        while not any(hold in " ".join(json.loads(x)["command"])
                      for x in open(os.environ["FAKE_SLURM_LOG"]).read().splitlines() if '"command"' in x):
            if time.monotonic() > deadline:
                sys.exit(f"fake srun: no step running {{hold!r}} within 60 s of the head step")
            time.sleep(0.05)
    sys.exit(0)  # log only
cwd = options.get("--container-workdir") or os.getcwd()
if "--container-image" in options:
    mounts = [m.split(":")[0] for m in str(options.get("--container-mounts", "")).split(",") if m]
    under_tmp = [m for m in mounts if m.startswith("/tmp/")]
    # A private /tmp per step, as every pyxis container has its own; the step's mounts that lie under
    # the host's /tmp (a checkout cloned there) are bound back in from it, as pyxis mounts them.
    script = ('mount --bind /tmp /mnt && mount -t tmpfs tmpfs /tmp && n=$1 && shift && '
              'while [ "$n" -gt 0 ]; do mkdir -p "$1" && mount --bind "/mnt/${{1#/tmp/}}" "$1" && shift && '
              'n=$((n - 1)); done && exec "$@"')
    command = ["unshare", "-rm", "--propagation", "private", "sh", "-c", script, "sh",
               str(len(under_tmp)), *under_tmp, *command]
os.chdir(cwd)
os.execvp(command[0], command)
'''

SCONTROL = r'''#!/bin/sh
if [ "$1" = show ] && [ "$2" = hostnames ]; then
  echo "$FAKE_SLURM_NODES" | tr ',' '\n'
  exit 0
fi
if [ "$1" = requeue ]; then
  echo "{\"scontrol\": \"requeue\", \"job\": \"$2\"}" >> "$FAKE_SLURM_LOG"
  exit 0
fi
echo "fake scontrol: unsupported: $*" >&2
exit 2
'''

HOSTNAME = r'''#!/bin/sh
if [ "$1" = --ip-address ] || [ "$1" = -i ]; then
  echo "${FAKE_HEAD_IP:-127.0.0.1}"
elif [ "$1" = -I ] || [ "$1" = --all-ip-addresses ]; then
  echo "${FAKE_HEAD_IPS:-${FAKE_HEAD_IP:-127.0.0.1}} "
else
  echo fake-node
fi
'''


def private_tmp_available() -> bool:
    """True when this host lets an unprivileged user make a mount namespace with its own /tmp."""
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "-rm", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs tmpfs /tmp && touch /tmp/x"], capture_output=True, timeout=30)
    return probe.returncode == 0


def install(bin_dir: Path) -> Path:
    """Write `srun`, `scontrol` and `hostname` (prints $FAKE_HEAD_IP for --ip-address, $FAKE_HEAD_IPS or else
    $FAKE_HEAD_IP for -I, as `hostname -I` does: space-separated, a trailing space) into bin_dir (put it
    first on PATH). With FAKE_SRUN_DRY=1, srun only logs its steps (and runs `hostname`)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (("srun", SRUN.format(python=sys.executable)), ("scontrol", SCONTROL),
                       ("hostname", HOSTNAME)):
        path = bin_dir / name
        path.write_text(text)
        path.chmod(0o755)
    return bin_dir


@contextlib.contextmanager
def reachable_head():
    """(ip, port) of a TCP port that answers on this host's first non-loopback IPv4 address, open for the
    block: a rendered script's wait for the Ray head's port then ends at once, as it does on a cluster once
    the head is up. Skips the test where the host has no such address."""
    ips = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split() \
        if shutil.which("hostname") else []
    ip = next((a for a in ips if "." in a and not a.startswith("127.")), None)
    if ip is None:
        import pytest
        pytest.skip(f"this host has no non-loopback IPv4 address (hostname -I: {ips})")
    with socket.socket() as listener:
        listener.bind((ip, 0))
        listener.listen(8)
        yield ip, listener.getsockname()[1]


def env(bin_dir: Path, log: Path, nodes: list[str], **extra: str) -> dict:
    """The environment a batch script sees inside the fake allocation."""
    # nothing of this host's Ray or SLURM settings leaks in (RAY_AUTH_*: the script decides the job's)
    e = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_TMPDIR", "RAY_AUTH", "SLURM_"))}
    e.update(PATH=f"{bin_dir}:{Path(sys.executable).parent}:{e.get('PATH', '')}", FAKE_SLURM_LOG=str(log),
             FAKE_SLURM_NODES=",".join(nodes), SLURM_JOB_NODELIST=",".join(nodes), SLURM_JOB_ID="4242",
             **extra)
    return e
