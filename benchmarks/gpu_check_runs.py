"""The GPU check's shared workspace and its `recipes.train` runs: sizes, the clock every section draws
its time from, the tokenizer and data built once for all sections, and recipe runs as subprocesses with a
timeout each (several at once where timing does not matter).

Time contract: `Clock` holds the whole check's deadline and each section's share of it (`SHARES`, in the
order the sections run): a section must end by the check's start + deadline x (its share + the shares
before it), so what one section leaves unused goes to the next. A run gets min(the per-run timeout, what
is left of its section) and is not started when less than `Sizes.min_run_s` is left (its row says so).
Every wait on another process has a timeout and kills the process group it started when it passes.

Nothing is compiled on the clock: the DeepSpeed engine steps with torch's fused AdamW on CUDA unless
DeepSpeed's own fused_adam is prebuilt (recipes.engines.deepspeed.runtime.optimizer), and the Triton kernels of the
loss pass are built by each section's warm-up, before its timed repeats.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]

# Llama-3.2-1B (config.json of meta-llama/Llama-3.2-1B): 16 layers of hidden 2048, tied embeddings, the
# Llama-3 vocabulary, Llama-3 RoPE scaling: a real small model whole, not a slice of a larger one
LLAMA32_1B = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
              "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "rope_theta": 500000.0,
              "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
              "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
              "vocab_size": 128_256}
# --smoke: the same family at tiny widths. The vocabulary stays the Llama-3 tokenizer's (the data's ids)
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 10000.0, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "vocab_size": 128_256}

# each section's share of the check's deadline, in the order they run (the numbers first)
SHARES = {"requirements": 0.05, "losses": 0.27, "steps": 0.43, "kernels": 0.13, "packing": 0.12}


@dataclass
class Sizes:
    """What the sections run at: the GPU sizes, or `--smoke`'s tiny ones on CPU."""

    device: str
    dtype: torch.dtype
    logits: tuple[int, int, int]  # [B, T, V] of the losses section (every term at N = 10 and 1000)
    more_vocabs: tuple[int, ...]  # ... and CE alone at these vocabulary widths too
    repeats: int
    dense: dict  # the steps section's model (widths, heads, vocabulary, layers)
    steps: int
    run_timeout_s: float  # one recipes.train run
    min_run_s: float  # a run is not started with less than this left of its section's time
    steps_parallel: int  # recipe runs at once in the steps section (1 on a GPU: they are timed)
    packing_parallel: int  # ... in the packing section (a correctness check: not timed)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @classmethod
    def of(cls, smoke: bool, steps: int) -> "Sizes":
        if smoke:
            # CPU: every run of a section at once (they are tiny; the test's time is mostly imports and start-up)
            return cls("cpu", torch.float32, (2, 16, 1200), (1500,), 2, TINY, 2, 600.0, 0.0, 4, 4)
        return cls("cuda", torch.bfloat16, (4, 2048, 128_256), (151_936,), 5, LLAMA32_1B, steps, 240.0, 40.0, 1, 2)


class Clock:
    """The check's deadline and each section's share of it (module docstring)."""

    def __init__(self, deadline_s: float, shares: dict = SHARES):
        self.start = time.time()
        self.deadline_s = deadline_s
        self.deadline = self.start + deadline_s
        self.shares = shares

    def left(self) -> float:
        return self.deadline - time.time()

    def section_deadline(self, section: str) -> float:
        """When `section` must end: the start + the deadline x the shares up to and including its own."""
        names = list(self.shares)
        share = sum(self.shares[n] for n in names[:names.index(section) + 1])
        return min(self.deadline, self.start + self.deadline_s * share)


# ---- the workspace: built once, shared by every section -------------------------------------------------


def tokenizer_dir(work: Path) -> Path:
    from recipes.experiments.real_tokenizers import assemble_tokenizer

    path = work / "tokenizer-llama3"
    if not (path / "tokenizer.json").is_file():
        assemble_tokenizer(str(path), "llama3")
    return path


def arithmetic_data(work: Path, tokenizer: Path, name: str, n: int, pack_length: int | None, max_length: int = 64,
                    seed: int = 0) -> tuple[Path, dict]:
    """Generated arithmetic problems (plain template) built into shards; returns (dir, manifest)."""
    from data_prep import BuildConfig, SourceConfig, TokenizeConfig, build
    from data_prep.shards import ShardConfig

    out = work / name
    if not (out / "manifest.json").is_file():
        source = SourceConfig("arithmetic", options={"n": n, "max_digits": 3, "negatives": False, "seed": seed})
        build(BuildConfig(sources=[source], tokenize=TokenizeConfig(str(tokenizer), template="plain",
                                                                     max_length=max_length, numeric_policy="integers"),
                          shards=ShardConfig(pack_length=pack_length)), str(out), workers=0, progress=False)
    return out, json.loads((out / "manifest.json").read_text())


def base_recipe(model: dict, data: Path, tokenizer: Path, dtype: str, terms: dict) -> dict:
    return {"name": "gpu-check", "model": {"config": model, "tokenizer": str(tokenizer), "dtype": dtype},
            "data": {"train": str(data), "shuffle_window": 64},
            "loss": {"numeric_policy": "integers", "objective": {"terms": terms}},
            "optim": {"lr": 1e-5, "schedule": "constant", "grad_clip": 1.0},
            "train": {"steps": 1, "save_every": 0, "progress": False, "tensorboard": False, "export": False,
                      "log_every": 1},
            # the step model predicts for the GPU it runs on (its name picks the peak, memory and GEMM rates)
            "cluster": {"gpus_per_node": 1, **({"gpu": torch.cuda.get_device_name()} if torch.cuda.is_available()
                                               else {})}}


def metrics(out_dir: Path) -> list[dict]:
    path = out_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def child_env(**extra: str) -> dict:
    """The environment of every process the check starts: the repository importable (no install needed)."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false", **extra}


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)


# ---- recipes.train runs ---------------------------------------------------------------------------------


@dataclass
class Run:
    """One `python -m recipes.train` of `recipe` (a world of one) into `out_dir`. `stop_at`: a file name in
    the run directory; once it exists the run is stopped (its process group killed) and counts as done."""

    recipe: dict
    out_dir: Path
    stop_at: str | None = None
    status: int | None = None
    output: str = ""
    skipped: str | None = None  # why it never started (its engine does not import, no time left)
    error: str | None = None  # why it has no result (timeout, exit status)
    seconds: float = 0.0
    key: dict = field(default_factory=dict)  # what the section's row says about the run before its results


def run_recipes(runs: list[Run], timeout_s: float, section_deadline: float, min_run_s: float, parallel: int,
                on_done: Callable[[Run], None] | None = None) -> list[Run]:
    """Run `runs` in order, `parallel` at a time, each under min(timeout_s, the section's time left); a run
    that would start with less than `min_run_s` left is skipped. Fills each Run's status / error / skipped."""
    pending, active = list(runs), []
    env = child_env(NVIDIA_TF32_OVERRIDE="0", **({"OMP_NUM_THREADS": "1"} if parallel > 1 else {}))
    while pending or active:
        for run in list(pending):
            if len(active) >= parallel:
                break
            left = section_deadline - time.time()
            if run.skipped is None and left < max(min_run_s, 1.0):
                run.skipped = f"not started: {left:.0f} s left of the section's time budget"
            pending.remove(run)
            if run.skipped is not None:
                on_done and on_done(run)
                continue
            run.out_dir.mkdir(parents=True, exist_ok=True)
            path = run.out_dir.parent / f"{run.out_dir.name}.yaml"
            path.write_text(yaml.safe_dump({**run.recipe, "train": {**run.recipe["train"],
                                                                     "out_dir": str(run.out_dir)}}))
            log = run.out_dir.parent / f"{run.out_dir.name}.log"
            fh = open(log, "w")
            proc = subprocess.Popen([sys.executable, "-m", "recipes.train", str(path)], cwd=REPO, env=env,
                                    stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
            print(f"[gpu_check] started {run.out_dir.name} ({min(timeout_s, left):.0f} s at most)", flush=True)
            active.append((run, proc, fh, log, time.time(), time.time() + min(timeout_s, left)))
        for item in list(active):
            run, proc, fh, log, t0, deadline = item
            status = proc.poll()
            if status is None and run.stop_at is not None and (run.out_dir / run.stop_at).is_file():
                kill_group(proc)
                status = 0
            elif status is None and time.time() > deadline:
                kill_group(proc)
                run.error = f"no result within {deadline - t0:.0f} s (log {log})"
                status = -9
            if status is None:
                continue
            fh.close()
            active.remove(item)
            run.status, run.seconds, run.output = status, time.time() - t0, log.read_text()
            if status != 0 and run.error is None:
                run.error = f"exit {status}: {run.output[-1500:]}"
            print(f"[gpu_check] {run.out_dir.name}: {run.error.splitlines()[0] if run.error else 'done'} "
                  f"({run.seconds:.0f} s)", flush=True)
            on_done and on_done(run)
        if pending or active:
            time.sleep(0.3)
    return runs
