"""The README's library example runs as written: its "Try it" block, taken from README.md, in a fresh
Python process on CPU (a character tokenizer and a tiny random Llama built in the block: no download)
within the subprocess's timeout; it trains, and the objective it prints goes down."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def try_it_block() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Try it", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, f"the Try it section holds {len(blocks)} python blocks"
    return blocks[0]


def test_the_readme_example_runs_as_written_and_trains():
    code = try_it_block()
    assert len(code.strip().splitlines()) <= 30  # one screen
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "2", "TRANSFORMERS_VERBOSITY": "error"})
    assert run.returncode == 0, run.stderr[-3000:]
    printed = {int(step): ast.literal_eval(values) for step, values in
               (line.split(" ", 1) for line in run.stdout.splitlines() if line[:1].isdigit())}
    assert sorted(printed) == [0, 10, 20, 29], run.stdout
    assert {"loss", "ce", "term/dist2", "numeric_positions"} <= set(printed[0])
    assert printed[0]["numeric_positions"] > 0
    assert printed[29]["loss"] < 0.5 * printed[0]["loss"], printed  # 30 steps on three rows: it learns them


def _versions_table() -> dict[str, str]:
    """The supported-versions table (docs/install.md, linked from the README's Install): row name -> its
    "tested here" cell."""
    text = (ROOT / "docs" / "install.md").read_text()
    table = text.split("| | tested here | declared |", 1)[1].split("\n\n", 1)[0]
    rows = [line.split("|")[1:-1] for line in table.strip().splitlines()[1:]]
    return {name.strip(): tested.strip() for name, tested, _ in rows}


def test_the_supported_versions_table_says_what_is_installed_here():
    """Each version the README says was tested is the one this environment runs (pip list would show
    another after an upgrade, and the table would then claim what was not tested)."""
    import platform
    import tomllib
    from importlib.metadata import PackageNotFoundError, version

    table = _versions_table()
    assert table["Python"] == platform.python_version()
    pairs = {"torch": ["torch"], "transformers": ["transformers"], "TRL / PEFT": ["trl", "peft"],
             "DeepSpeed": ["deepspeed"], "megatron-core": ["megatron-core"], "Ray": ["ray"],
             "wandb / mlflow-skinny": ["wandb", "mlflow-skinny"]}
    for row, packages in pairs.items():
        claimed = [v.split(" ")[0] for v in table[row].split(" / ")]
        for package, want in zip(packages, claimed):
            try:
                found = version(package)
            except PackageNotFoundError:
                continue  # not installed here: nothing to compare
            assert found.split("+")[0] == want, (row, package, found, want)
    # the lock `make test` installs from holds the same versions, so a clean clone tests what the table says
    locked = dict(line.lower().split("==") for line in (ROOT / "constraints.txt").read_text().split()
                  if "==" in line and not line.startswith("#"))
    for row, packages in pairs.items():
        claimed = [v.split(" ")[0] for v in table[row].split(" / ")]
        for package, want in zip(packages, claimed):
            assert locked.get(package) == want, ("constraints.txt", package, locked.get(package), want)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "deepspeed==" + table["DeepSpeed"] in extras["train"]
    assert "megatron-core==" + table["megatron-core"] in extras["megatron"]


def test_license_and_citation():
    import tomllib

    import yaml

    assert (ROOT / "LICENSE").read_text().split()[:3] == ["Apache", "License", "Version"]
    citation = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert citation["license"] == "Apache-2.0" and citation["cff-version"] == "1.2.0"
    assert citation["version"] == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    readme = (ROOT / "README.md").read_text()
    for ref in citation["references"]:  # every paper the citation names is linked from the README's table
        assert ref["url"] in readme, ref["url"]


def starter_block() -> list[str]:
    """The commands of the CPU starter: the first bash block of docs/recipes.md (the README points there)."""
    text = (ROOT / "docs" / "recipes.md").read_text()
    assert "(docs/recipes.md)" in (ROOT / "README.md").read_text()
    section = text.split("\n## A CPU starter", 1)[1].split("\n## ", 1)[0]
    block = re.findall(r"```bash\n(.*?)```", section, flags=re.S)[0]
    return [line.split("  #", 1)[0].strip() for line in block.strip().splitlines()]


def test_the_readme_cpu_starter_runs_as_written_with_no_hub(tmp_path):
    """Every command of the starter, in a fresh directory beside a link to the checkout's recipes/ (so
    runs/ lands there), with the Hub unreachable (HF_HUB_OFFLINE) and no cache: the tokenizer, both
    builds, the training (20 of its steps here: `train.steps=20 train.save_every=10` appended, the rest as
    written), the evaluation of its export and the table with the interval."""
    commands = starter_block()
    assert [c.split()[:3] for c in commands] == [["python", "-m", "recipes.experiments.tiny"],
                                                 ["python", "-m", "data_prep"], ["python", "-m", "data_prep"],
                                                 ["python", "-m", "recipes.train"], ["python", "-m", "recipes.evaluate"],
                                                 ["python", "-m", "recipes.evaluate"]], commands
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "2",
           "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "no-cache"), "TRANSFORMERS_VERBOSITY": "error"}
    outputs = []
    for command in commands:
        argv = [sys.executable, *command.split()[1:]]
        if "recipes.train" in command:
            argv += ["train.steps=20", "train.save_every=10"]
        run = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
        assert run.returncode == 0, (command, run.stdout[-2000:], run.stderr[-3000:])
        outputs.append(run.stdout)
    final = tmp_path / "runs" / "starter" / "final"
    results = json.loads((final / "eval_results.json").read_text())
    assert results["export"]["step"] == 20 and results["metrics"]["n"] == 100
    low, high = results["metrics"]["exact_match_95ci"]
    assert 0 <= low <= results["metrics"]["exact_match"] <= high <= 1
    table = outputs[-1].strip().splitlines()
    assert "exact match [95% CI]" in table[0] and table[2].startswith("| starter |"), table
    train_out = outputs[3]
    assert "predicted on the recipe's GPUs (" in train_out  # one short line, not the plan's assumptions
    assert max(len(line) for line in train_out.splitlines() if line.startswith("[numloss] predicted")) < 200
