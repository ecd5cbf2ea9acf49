"""Preemption on SLURM: the rendered torchrun script under a fake srun/scontrol
(tests/launch/fake_slurm.py) and a fake `torchrun` that trains until `<out_dir>/PREEMPT` appears, as
rank 0 of recipes.train does (the real run's side is tests/recipes/reliability/test_preemption.py).

SIGUSR1 to the batch shell (what `#SBATCH --signal=B:USR1@N` sends N seconds before the time limit):
its trap writes PREEMPT while the step goes on, the run stops, and the script requeues the job and
exits with the run's status. Not simulated: a real Slurm's timing of the signal and the requeue."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time

import yaml

from launch.slurm import render

FAKE_TORCHRUN = """#!/bin/sh
# stands for the training job: runs until the run directory's PREEMPT file appears, then exits 1 as
# torchrun does when its ranks exit 75
out="$(echo "$@" | sed -n 's/.*train.out_dir=\\([^ ]*\\).*/\\1/p')"
touch "$out/started"
while [ ! -e "$out/PREEMPT" ]; do sleep 0.1; done
echo "fake training: PREEMPT seen, checkpoint saved" >&2
exit 1
"""


def test_sigusr1_before_the_time_limit_saves_through_the_trap_and_requeues(tmp_path):
    from . import fake_slurm

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "r", "model": {"name_or_path": "org/model"},
                                      "data": {"train": "data"}, "cluster": {"nodes": 1, "gpus_per_node": 8}}))
    out = tmp_path / "run"
    text = render(recipe, "torchrun", [f"train.out_dir={out}", "cluster.preempt_notice_s=240"],
                  workdir=str(tmp_path))
    assert "#SBATCH --signal=B:USR1@240" in text and "#SBATCH --requeue" in text
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    bin_dir = fake_slurm.install(tmp_path / "bin")
    (bin_dir / "torchrun").write_text(FAKE_TORCHRUN)
    (bin_dir / "torchrun").chmod(0o755)
    log = tmp_path / "slurm.jsonl"
    proc = subprocess.Popen(["bash", str(script)], env=fake_slurm.env(bin_dir, log, ["node1"]), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not (out / "started").exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGUSR1)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1, stdout + stderr
    assert "SIGUSR1: the time limit is near" in stderr and "requeueing" in stderr, stderr
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert {"scontrol": "requeue", "job": "4242"} in entries


def test_no_notice_no_signal_and_no_requeue(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "r", "model": {"name_or_path": "org/model"},
                                      "data": {"train": "data"}, "cluster": {"preempt_notice_s": 0}}))
    for mode in ("torchrun", "ray"):
        text = render(recipe, mode)
        assert re.search(r"^#SBATCH --(signal|requeue)", text, re.M) is None and "PREEMPT=0" in text
