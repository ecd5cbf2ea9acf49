"""The GPU check's shared workspace and its `recipes.train` runs: sizes, the clock every section draws
its time from, the tokenizer and data built once for all sections, recipe runs as subprocesses with a
timeout each (several at once where timing does not matter), and DeepSpeed's FusedAdam build started in
the background at the start of the check.

Time contract: `Clock` holds the whole check's deadline; a section gets `Clock.budget(section)` =
min(its own budget, what is left of the deadline); a run gets min(the per-run timeout, what is left of its
section's budget) and is not started when less than `Sizes.min_run_s` is left (its row says so). Every
wait on another process (a run, the FusedAdam build) has a timeout and kills the process group it
started when it passes.
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

# Llama-3-8B's widths (config.json of meta-llama/Meta-Llama-3-8B): the layer slice keeps them
LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
             "num_key_value_heads": 8, "rope_theta": 500000.0, "max_position_embeddings": 8192,
             "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "vocab_size": 128_256}
# Qwen3-30B-A3B's public widths (config.json of Qwen/Qwen3-30B-A3B): every layer sparse, 128 experts, top 8
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                 "moe_intermediate_size": 768, "intermediate_size": 6144, "norm_topk_prob": True,
                 "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.001,
                 "rope_theta": 1000000.0, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
                 "tie_word_embeddings": False, "vocab_size": 151_936}
# --smoke: the same families at tiny widths. The vocabulary stays the Llama-3 tokenizer's (the data's ids)
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rope_theta": 10000.0, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "vocab_size": 128_256}
TINY_MOE = {**QWEN3_30B_A3B, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "intermediate_size": 128, "max_position_embeddings": 2048, "vocab_size": 128_256}


@dataclass
class Sizes:
    """What the sections run at: the GPU sizes, or `--smoke`'s tiny ones on CPU."""

    device: str
    dtype: torch.dtype
    logits: tuple[int, int, int]  # [B, T, V] of the losses section
    repeats: int
    dense: dict  # the steps section's dense model (widths, heads, vocabulary)
    moe: dict  # its mixture-of-experts model
    layers: int
    steps: int
    run_timeout_s: float  # one recipes.train run
    min_run_s: float  # a run is not started with less than this left of its section's budget
    steps_parallel: int  # recipe runs at once in the steps section (1 on a GPU: they are timed)
    packing_parallel: int  # ... in the packing section (a correctness check: not timed)
    budgets_s: dict = field(default_factory=dict)  # section -> its own time budget

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @classmethod
    def of(cls, smoke: bool, layers: int, steps: int) -> "Sizes":
        if smoke:
            # CPU: every run of a section at once (they are tiny; the test's time is mostly imports and start-up)
            return cls("cpu", torch.float32, (2, 16, 1200), 2, TINY, TINY_MOE, 2, 2, 600.0, 0.0, 4, 4,
                       {"requirements": 120, "kernels": 300, "losses": 300, "packing": 600, "steps": 600})
        # One H200: ~7 min in all with a cold FusedAdam build (docs/benchmarks.md, the GPU check)
        return cls("cuda", torch.bfloat16, (4, 2048, 128256), 5, LLAMA3_8B, QWEN3_30B_A3B, layers, steps, 240.0,
                   45.0, 1, 4, {"requirements": 90, "kernels": 150, "losses": 180, "packing": 150, "steps": 330})


class Clock:
    """The check's deadline and each section's share of it (module docstring)."""

    def __init__(self, deadline_s: float, budgets_s: dict):
        self.start = time.time()
        self.deadline = self.start + deadline_s
        self.budgets_s = budgets_s

    def left(self) -> float:
        return self.deadline - time.time()

    def section_deadline(self, section: str) -> float:
        return min(self.deadline, time.time() + self.budgets_s.get(section, self.left()))


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
            "cluster": {"gpus_per_node": 1}}


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


# ---- DeepSpeed's FusedAdam, built while the first sections run ------------------------------------------


class Prebuild:
    """A background process (its own process group) that the DeepSpeed runs wait on with a timeout.

    On a GPU it JIT-builds DeepSpeed's fused_adam op (nvcc, ~1 min cold; a warm torch-extensions cache
    loads it in seconds) into the cache the recipe runs then load from. On CPU the DeepSpeed engine runs
    torch's AdamW (nothing to build), and `--smoke` waits on an import of deepspeed instead, so the waiting
    code runs there too."""

    def __init__(self, work: Path, cuda: bool, timeout_s: float):
        self.what = "DeepSpeed fused_adam JIT build" if cuda else "deepspeed import (CPU: no op to build)"
        code = ("from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load(); print('built')"
                if cuda else "import deepspeed; print('imported')")
        self.log = work / "prebuild.log"
        self.started = time.time()
        self.timeout_s = timeout_s
        with open(self.log, "w") as fh:
            self.proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=child_env(), stdout=fh,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.result: str | None = None  # None while running; "" once built; else why not

    def poll(self) -> str | None:
        """None while it runs (and its time is not up); "" when it succeeded; else the failure."""
        if self.result is not None:
            return self.result
        status = self.proc.poll()
        if status is None and time.time() - self.started > self.timeout_s:
            kill_group(self.proc)
            self.result = f"{self.what} did not finish in {self.timeout_s:.0f} s (log {self.log})"
        elif status is not None:
            self.result = "" if status == 0 else f"{self.what} failed, exit {status}: {self.log.read_text()[-600:]}"
        if self.result is not None:
            print(f"[gpu_check] {self.what}: {self.result or 'done'} after {time.time() - self.started:.0f} s",
                  flush=True)
        return self.result

    def stop(self) -> None:
        if self.proc.poll() is None:
            kill_group(self.proc)


# ---- recipes.train runs ---------------------------------------------------------------------------------


@dataclass
class Run:
    """One `python -m recipes.train` of `recipe` (a world of one) into `out_dir`. `stop_at`: a file name in
    the run directory; once it exists the run is stopped (its process group killed) and counts as done.
    `after`: a Prebuild the run waits for before it starts."""

    recipe: dict
    out_dir: Path
    stop_at: str | None = None
    after: Prebuild | None = None
    status: int | None = None
    output: str = ""
    skipped: str | None = None  # why it never started (its engine does not import, no time left)
    error: str | None = None  # why it has no result (timeout, exit status, the FusedAdam build failed)
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
            if run.after is not None:
                waited = run.after.poll()
                if waited is None:
                    continue  # the build is still going: a later run may start first
                if waited:  # the DeepSpeed engine cannot run its GPU optimizer: a failure, not a skip
                    run.error = f"waited for {run.after.what}: {waited}"
            left = section_deadline - time.time()
            if run.error is None and left < max(min_run_s, 1.0):
                run.skipped = f"not started: {left:.0f} s left of the section's time budget"
            pending.remove(run)
            if run.skipped is not None or run.error is not None:
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
