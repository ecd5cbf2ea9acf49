"""The wheels a lent GPU machine lacks, carried there with the working tree (it has no network).

    python benchmarks/gpu_wheels.py download [--dest .whl]   # here, where pip reaches the index (make gpu-wheels)
    python benchmarks/gpu_wheels.py check [--dest .whl]      # there, before anything is installed (gpu_run.sh)

The GPU image (Python 3.12, torch 2.11 with CUDA 13, triton 3.6, transformers 5.17, accelerate, peft,
pyarrow, tokenizers, pytest, psutil, msgpack, einops, ninja, py-cpuinfo, nvidia-ml-py, tqdm) holds
everything `recipes.train` and the GPU check import except `CARRIED` below. Each is taken at the version
`constraints.txt` locks (the versions the CPU suite ran), for CPython 3.12 on manylinux x86-64, one wheel
each. DeepSpeed publishes a source distribution only: its wheel is built here with no ops prebuilt
(`DS_BUILD_OPS=0`, `DS_ACCELERATOR=cuda`: pure Python; the engine then steps with torch's fused AdamW on
CUDA, and nothing compiles on the GPU's clock). transformers stays the image's 5.17 (5.25 would need a
newer huggingface_hub and its own dependencies: more than it is worth for the check; the requirements table
notes the difference). Transformer Engine is not carried (its CUDA wheels are far over the carry limit).

`download` empties `dest`, fetches and builds, and writes `dest/wheels.json` (file, version, sha256, bytes
of each); it fails when the wheels with the tracked tree would pass the carry limit. `check` fails (exit 2,
naming each problem) unless `dest` holds exactly one wheel of each carried distribution at its pinned
version with the recorded sha256, so a stale or partial folder stops before the GPU's time is spent.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CARRIED = ("deepspeed", "megatron-core", "pydantic", "pydantic_core", "annotated-types", "typing-inspection",
           "typing_extensions", "hjson")
BUILT_HERE = {"deepspeed": {"DS_BUILD_OPS": "0", "DS_ACCELERATOR": "cuda"}}  # sdist only on the index
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
            "--platform", "manylinux_2_27_x86_64", "--platform", "manylinux_2_24_x86_64", "--platform",
            "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64"]
CARRY_LIMIT = 64 * 2**20  # what travels to the GPU machine: the tracked tree plus the carried paths
RECORD = "wheels.json"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned(constraints: Path = REPO / "constraints.txt") -> dict[str, str]:
    """Each carried distribution's version in `constraints`; a KeyError names any that is not locked there."""
    locked = {}
    for line in constraints.read_text().splitlines():
        if "==" in line and not line.lstrip().startswith("#"):
            name, version = line.split(";")[0].strip().split("==", 1)
            locked[canonical(name)] = version.strip()
    missing = [n for n in CARRIED if canonical(n) not in locked]
    if missing:
        raise KeyError(f"{constraints}: no locked version of {', '.join(missing)}")
    return {n: locked[canonical(n)] for n in CARRIED}


def wheel_of(path: Path) -> tuple[str, str]:
    """(canonical distribution name, version) from a wheel's file name."""
    name, version = path.name.split("-")[:2]
    return canonical(name), version


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tracked_bytes() -> int:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
    return sum((REPO / f.decode()).stat().st_size for f in files if f and (REPO / f.decode()).is_file())


def download(dest: Path) -> int:
    versions = pinned()
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    for name, version in versions.items():
        spec = f"{name}=={version}"
        if name in BUILT_HERE:
            with tempfile.TemporaryDirectory() as tmp:
                cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-cache-dir", "--no-deps", "--no-build-isolation",
                       "-w", tmp, spec]
                subprocess.run(cmd, check=True, env={**os.environ, **BUILT_HERE[name]}, cwd=tmp)
                for built in Path(tmp).glob("*.whl"):
                    built.rename(dest / built.name)
        else:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                            *PLATFORM, "-d", str(dest), spec], check=True)
    record = {wheel_of(w)[0]: {"file": w.name, "version": wheel_of(w)[1], "sha256": sha256(w),
                               "bytes": w.stat().st_size} for w in sorted(dest.glob("*.whl"))}
    (dest / RECORD).write_text(json.dumps(record, indent=1))
    problems = check(dest)
    total = sum(r["bytes"] for r in record.values()) + tracked_bytes()
    if total > CARRY_LIMIT:
        problems.append(f"the tracked tree and the wheels are {total / 2**20:.1f} MiB, over the carry limit "
                        f"({CARRY_LIMIT / 2**20:.0f} MiB)")
    for line in problems:
        print(f"gpu_wheels: {line}", file=sys.stderr)
    print(f"gpu_wheels: {len(record)} wheels in {dest}, {sum(r['bytes'] for r in record.values()) / 2**20:.1f} MiB; "
          f"with the tracked tree {total / 2**20:.1f} MiB of {CARRY_LIMIT / 2**20:.0f}")
    return 2 if problems else 0


def check(dest: Path, versions: dict[str, str] | None = None) -> list[str]:
    """What is wrong with `dest` as the carried wheels (nothing: [])."""
    versions = versions if versions is not None else pinned()
    if not dest.is_dir():
        return [f"{dest} does not exist: run `make gpu-wheels` where pip reaches the index"]
    found: dict[str, list[Path]] = {}
    for wheel in sorted(dest.glob("*.whl")):
        found.setdefault(wheel_of(wheel)[0], []).append(wheel)
    record_path = dest / RECORD
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    problems = [] if record else [f"{record_path} is missing: the folder was not made by `make gpu-wheels`"]
    for name, version in versions.items():
        wheels = found.pop(canonical(name), [])
        if not wheels:
            problems.append(f"no wheel of {name}=={version} in {dest}")
        elif len(wheels) > 1:
            problems.append(f"{len(wheels)} wheels of {name} in {dest} ({', '.join(w.name for w in wheels)}): "
                            "pip would refuse the install; keep one")
        elif wheel_of(wheels[0])[1] != version:
            problems.append(f"{wheels[0].name} is not the pinned {name}=={version}")
        elif record and record.get(canonical(name), {}).get("sha256") != sha256(wheels[0]):
            problems.append(f"{wheels[0].name} does not match its sha256 in {record_path}")
    problems += [f"{', '.join(w.name for w in ws)}: not a carried distribution" for ws in found.values()]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("verb", choices=("download", "check"))
    parser.add_argument("--dest", default=str(REPO / ".whl"))
    args = parser.parse_args(argv)
    dest = Path(args.dest)
    if args.verb == "download":
        return download(dest)
    problems = check(dest)
    for line in problems:
        print(f"gpu_wheels check: {line}", file=sys.stderr)
    if not problems:
        print(f"gpu_wheels check: {dest} holds the {len(CARRIED)} carried wheels at their pinned versions")
    return 2 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
