"""Run `recipes.train` as a real 2-rank torchrun job on CPU (gloo) and read what it logged."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


EXIT_REPORT = Path(__file__).parent / "exit_report"  # its sitecustomize prints each rank's threads at exit


def launch(recipe: Path, out_dir: Path, *overrides: str, nproc: int = 2, log: Path | None = None,
           exit_report: bool = False, site: Path | None = None, env: dict | None = None) -> subprocess.Popen:
    """torchrun of `recipes.train`. Its output goes to a pipe (read it with `communicate`) or, for a run
    that is watched rather than read, to the file `log`: an unread pipe fills up and blocks the ranks.
    With `exit_report` each rank ends its output with the threads it still has at exit
    (`exit_threads` reads them). `site`: another folder with a sitecustomize.py on the ranks' PYTHONPATH (a
    fault to inject; Python loads one sitecustomize, so not with `exit_report`), `env`: variables added to
    the job's environment."""
    if exit_report and site is not None:
        raise ValueError("exit_report and site each need their own sitecustomize: give one")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "recipes.train", str(recipe), f"train.out_dir={out_dir}", *overrides]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **(env or {})}
    for folder in (EXIT_REPORT if exit_report else None, site):
        if folder is not None:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), env.get("PYTHONPATH")]))
    stdout = subprocess.PIPE if log is None else open(log, "w")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=stdout, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def exit_threads(output: str) -> dict[int, list[list[str]]]:
    """Each rank's thread names at exit, one list per process that rank ran (a Megatron run starts more
    than one), from the output of a run launched with `exit_report`."""
    found: dict[int, list[list[str]]] = {}
    for line in output.splitlines():
        if "[exit-threads] rank=" in line:
            rank, *names = line.split("[exit-threads] rank=", 1)[1].split()
            found.setdefault(int(rank), []).append(names)
    return found


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a process that ended while we looked
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def rank_pids(proc, world: int = 2, timeout: float = 300) -> dict[int, int]:
    """{rank: pid} of a torchrun job's ranks (their RANK variable), once all `world` exist."""
    deadline = time.time() + timeout
    while True:
        found = {}
        for pid in _descendants(proc.pid):
            try:
                env = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
            except OSError:
                continue  # ended while we looked
            if "RANK" in env and env.get("TORCHELASTIC_RUN_ID"):
                found[int(env["RANK"])] = pid
        if len(found) == world:
            return found
        assert proc.poll() is None and time.time() < deadline, f"ranks found: {found}"
        time.sleep(0.05)


def catches(pid: int, *signals: signal.Signals) -> bool:
    """Whether the process has a handler installed for each signal (/proc/PID/status SigCgt)."""
    try:
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    mask = int(line.split()[1], 16)
    return all(mask >> (s - 1) & 1 for s in signals)


def kill_after_logged_steps(proc: subprocess.Popen, out_dir: Path, steps: int, timeout: float = 600) -> None:
    """Wait until the run has logged `steps` optimizer steps, then SIGKILL the whole job, as a crashed
    node would: torchrun and every rank. Killing torchrun's process group is not enough, because torch
    elastic starts each rank in a session of its own; a surviving rank would go on training into the
    same run directory next to the restarted job."""
    metrics = out_dir / "metrics.jsonl"
    deadline = time.time() + timeout
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.time() < deadline, f"the run logged fewer than {steps} steps in {timeout} s"
        time.sleep(0.05)
    job = [proc.pid, *_descendants(proc.pid)]
    for pid in job:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    while any(Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid) for pid in job[1:]):
        assert time.time() < deadline + 30, "a rank of the killed job is still alive"
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return "zombie" if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z" else "alive"
    except (OSError, IndexError):
        return "zombie"  # gone


def run_to_end(recipe: Path, out_dir: Path, *overrides: str, env: dict | None = None) -> str:
    proc = launch(recipe, out_dir, *overrides, env=env)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-4000:]
    return output


def run_in_ranks(recipe: Path, out_dir: Path, *overrides: str, nproc: int = 2) -> str:
    """`run_to_end` where the property is a number (losses, files written, what the run says), not a
    process's life: the same loop and engine in `nproc` fork-server ranks (`tests.distributed.
    train_in_ranks`), without the interpreter starts and imports of a torchrun job. Fails with every rank's
    error; returns every rank's output (also kept beside `out_dir`, one file per run)."""
    from tests.distributed import train_in_ranks

    out_dir = Path(out_dir)
    log = out_dir.with_name(f"{out_dir.name}.{len(list(out_dir.parent.glob(f'{out_dir.name}.*.log')))}.log")
    outcomes = train_in_ranks(nproc, [str(recipe), f"train.out_dir={out_dir}", *overrides], log=log)
    output = log.read_text()
    assert all(o["error"] is None for o in outcomes), f"{outcomes}\n{output[-4000:]}"
    return output


def read_metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def save_tiny_llama(tokenizer_dir: Path, out_dir: Path, hidden: int = 32, seed: int = 0, **config):
    """A random-weight tiny Llama sized to the tokenizer at `tokenizer_dir`, saved with that tokenizer
    into `out_dir` (fixed seed: every run of a test starts from the same weights). `config`: entries of
    its Hugging Face config to set (e.g. attention_dropout). Returns the tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from recipes.experiments.tiny import tiny_llama_config

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    cfg = {**tiny_llama_config(len(tok), hidden=hidden), **config}
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg)).save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))
    return tok


def tiny_workspace(root: Path, *, problems: int, max_digits: int, train: dict, terms: tuple[str, ...] = ("smmd",),
                   optim: dict | None = None, hidden: int = 64, module: str | None = None,
                   lora: dict | None = None) -> Path:
    """The small training set-up the recipe tests share, written into `root`: a digits tokenizer (`tok/`),
    `problems` arithmetic problems of up to `max_digits` digits (one `module` of the generator, or its mix)
    tokenized with it (`data/`), and `recipe.yaml`, which trains a random-weight tiny Llama of width
    `hidden` sized to the tokenizer on them with CE + `terms` at their default weights, `optim` (default
    lr 3e-3) and `train`. With `lora` the model is that Llama saved once into `base/` (seed 0) with the
    adapter `lora` on it. Returns the recipe's path."""
    import yaml

    from data_prep.sources.base import SourceConfig
    from recipes.experiments.tiny import build_plain_shards, tiny_llama_config, train_tokenizer

    tok = train_tokenizer(["Calculate 0123456789 + - * / = . ( )"], root / "tok", "digits")
    options = {"n": problems, "max_digits": max_digits, "negatives": False, **({"module": module} if module else {})}
    build_plain_shards(SourceConfig(kind="arithmetic", options=options), root / "tok", root / "data")
    model = {"config": tiny_llama_config(len(tok), hidden=hidden)}
    if lora is not None:
        save_tiny_llama(root / "tok", root / "base", hidden=hidden)
        model = {"name_or_path": str(root / "base"), "lora": lora}
    recipe = {"name": "tiny", "model": {**model, "tokenizer": str(root / "tok"), "dtype": "float32"},
              "data": {"train": str(root / "data")}, "loss": {"objective": {"terms": {t: {} for t in terms}}},
              "optim": optim or {"lr": 3e-3}, "train": {"progress": False, **train}}
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path
