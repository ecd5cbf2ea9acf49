"""tests/conftest.py: under two xdist workers (`make test`) a file runs whole on one worker and every
file of tests/launch on the same one (one simulated Ray cluster at a time). Run on a small tree of its
own with a copy of the conftest: xdist's `loadgroup` marks silently grouped nothing under pytest 9,
so the split is checked where it happens, in real worker processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist")

RECORD = """
import json, os

def _record(name):
    with open(os.environ["SPLIT_LOG"], "a") as f:
        f.write(json.dumps({{"file": __file__.split("tests/", 1)[1], "worker": os.environ["PYTEST_XDIST_WORKER"]}}) + "\\n")

{tests}
"""


def _write_test_file(path: Path, n: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(RECORD.format(tests="\n".join(f"def test_{i}():\n    _record({i})\n" for i in range(n))))


def test_a_file_and_the_launch_folder_each_run_on_one_worker(tmp_path):
    root = tmp_path / "tree"
    (root / "tests").mkdir(parents=True)
    for name in ("conftest.py", "expected_skips.py", "__init__.py"):  # the conftest imports the skip ledger
        shutil.copy(Path(__file__).with_name(name), root / "tests" / name)
    (root / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    # more tests in test_a and test_b than in the launch folder: xdist's own order would start those two
    sizes = {"launch/test_ray.py": 3, "launch/test_slurm.py": 3, "test_a.py": 8, "test_b.py": 8, "test_c.py": 2}
    for name, n in sizes.items():
        _write_test_file(root / "tests" / name, n)
    log = tmp_path / "split.jsonl"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile",
                           "tests"], cwd=root, env={**os.environ, "SPLIT_LOG": str(log)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(rows) == sum(sizes.values())
    workers = {}
    for row in rows:
        workers.setdefault(row["file"], set()).add(row["worker"])
    assert all(len(w) == 1 for w in workers.values()), workers  # a file whole on one worker
    assert workers["launch/test_ray.py"] == workers["launch/test_slurm.py"], workers  # the launch folder together
    # the launch folder is handed out first (the longest unit): its worker starts with it
    (launch_worker,) = workers["launch/test_ray.py"]
    assert next(r for r in rows if r["worker"] == launch_worker)["file"].startswith("launch/"), rows
    assert {w for ws in workers.values() for w in ws} == {"gw0", "gw1"}  # and both workers had work
