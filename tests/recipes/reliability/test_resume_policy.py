"""recipes.reliability.resume_policy (with recipe_history, and the checkpoints it resumes from): what a start
on an existing run directory does with the recipe it is given. A changed recipe applies from the resume
step, a finished run says so, and what the checkpoint cannot take is refused before any model is built
and before anything in the run directory is rewritten (recipe.yaml, recipe_history.jsonl).

Without processes: the decisions (`decide`) on a default weight written out, a grown schema, fewer steps
than the checkpoint, a checkpoint that does not record its recipe; the history of the recipes of each
step; every recipe key classified in `POLICY`; the ZeRO stage compared as DeepSpeed runs it; the global
batch compared across layouts and splits.

Every start that ends before an engine is built (the refusals below, and a finished run started again)
is a call of `recipes.train.main`, the function `python -m recipes.train` runs, in one long-lived Python
process shared by the module (`Starts`): its exit status, stdout and stderr, without ~10 s of imports per
start. Starts that train run the loop in pre-started ranks (`run_in_ranks`: what they show is numbers and
lines), but for the one whose property is a process's (the full disk's exit status, a torchrun `launch`).

Refusals, on one real run (DeepSpeed ZeRO-3, one process, 2 steps), then each start on it: a global
batch the checkpoint cannot take (unchecked, the engine would be built and the reader raise a plain
ValueError, exit 1); a ZeRO stage changed in `deepspeed.zero_stage` (DeepSpeed's AssertionError, with a
hint to fall back to an older checkpoint; a stage `deepspeed.overrides` sets against the key is refused
when the recipe loads: recipes/engines/deepspeed/pure/config.py); a truncated shard, and with `data.verify:
full` a shard of the same size changed (recipes/checks/preflight.py: otherwise named only after the model
loaded, or after recipe.yaml and the history were rewritten).

Resumes: `recipes.train` on a tiny Llama, DeepSpeed ZeRO-3 on 2 torchrun ranks and Megatron on 1. A run
never loses a checkpoint to a failed save (recipes.reliability.checkpoints, checkpoint_writes), and a
changed recipe on resume does what docs/reliability.md says.

DeepSpeed, one run directory, in order:
1. steps 1-6, save_every 2, keep_last 1; rank 1's write of step 4 fails with ENOSPC (a sitecustomize
   makes its torch.save write half the file, then fail). Both ranks exit 74 together (a failure not
   shared would leave rank 0 waiting in DeepSpeed's closing barrier), the message names the rank, the
   file, the error and the free space; `latest` is step 2 and nothing of step 4 is left (a half-written
   `step_00000004/` would outrank step 2 when pruning by name).
2. The same command with `train.save_every=1` (a resumable change): resumes from step 2, saves every step
   with keep_last 1 (pruning leaves the newest only), finishes at 6; every step logged once.
3. `train.steps=8`, `optim.lr` 10x lower, the SMMD weight 3 -> 1: resumes from step 6; step 7 runs at the
   new cosine's value (computed here by hand), its row records the change, the loss is CE + 1 x SMMD from
   step 7 on (3 x SMMD before), the change line is printed, recipe_history.jsonl holds every recipe with
   the step it took over, recipe.yaml the current one.
4. One process, no engine: the same recipe again says it is finished (exit 0); another lr is refused
   (exit 2, `final/` untouched); another seed with more steps is refused before any engine is built.
Megatron: 4 steps, then 6 at a 10x lower lr: step 5 runs at the new schedule's value.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from recipes.config import recipe_from_dict
from recipes.reliability.recipe_history import HISTORY, read_history, record_start, recipe_of_step
from recipes.reliability.resume_policy import ResumeRefused, decide
from tests.recipes.torchrun_helpers import REPO, launch, read_metrics, run_in_ranks, save_tiny_llama, tiny_workspace

pytestmark = pytest.mark.timeout(900)

DISK_FULL = Path(__file__).resolve().parents[1] / "disk_full"  # its sitecustomize: ENOSPC on one rank's save
LR, LOW, FLOOR, WARMUP = 3e-3, 3e-4, 0.1, 2  # LOW: the 10x lower lr of a resume


def _recipe(tmp_path, *overrides: str):
    base = {"name": "r", "model": {"config": {"model_type": "llama"}, "tokenizer": "tok"},
            "data": {"train": "data"}, "loss": {"objective": {"terms": {"smmd": {}}}},
            "optim": {"lr": 1e-3, "warmup_steps": 0, "schedule": "constant"},
            "train": {"steps": 10, "out_dir": str(tmp_path), "export": False}}
    return recipe_from_dict(base, list(overrides))


def test_a_default_weight_written_out_and_a_grown_schema_are_no_change(tmp_path):
    saved = _recipe(tmp_path).to_dict()
    del saved["data"]["length_bucketing"]  # a field added to the schema after the checkpoint was saved
    plan = decide(_recipe(tmp_path, "loss.objective={terms: {smmd: {weight: 3.0}}}"), "step_00000004", saved, tmp_path)
    assert plan.changes == [] and not plan.finished and plan.first_step == 5
    plan = decide(_recipe(tmp_path, "loss.objective={terms: {smmd: {weight: 1.0}, ntl_was: {}}}"), "step_00000004",
                  saved, tmp_path)
    assert {c.key: (c.old, c.new) for c in plan.changes} == {
        "loss.objective.terms.smmd.weight": (3.0, 1.0),
        "loss.objective.terms.ntl_was": ("(absent)", {"weight": 0.3, "options": {}, "rescale_to_ce": False})}


def test_fewer_steps_than_the_checkpoint_and_a_run_without_a_recorded_recipe(tmp_path):
    with pytest.raises(ResumeRefused, match=r"train.steps: 3 is below step 4, where this run's checkpoint"):
        decide(_recipe(tmp_path, "train.steps=3"), "step_00000004", _recipe(tmp_path).to_dict(), tmp_path)
    plan = decide(_recipe(tmp_path, "optim.lr=1.0"), "step_00000004", None, tmp_path)  # saved before recipe.json
    assert plan.changes == [] and "does not record the recipe it was trained with" in plan.warnings[0]
    # train.steps lowered to the checkpoint's step (stop here): with an export to write, the run exports;
    # without, there is nothing to do; neither is refused
    plan = decide(_recipe(tmp_path, "train.steps=4", "train.export=true"), "step_00000004",
                  _recipe(tmp_path, "train.export=true").to_dict(), tmp_path)
    assert not plan.finished and [c.key for c in plan.changes] == ["train.steps"]
    plan = decide(_recipe(tmp_path, "train.steps=4"), "step_00000004", _recipe(tmp_path).to_dict(), tmp_path)
    assert plan.finished and "Ignored: train.steps: 10 -> 4" in plan.message


def test_history_keeps_the_recipes_of_the_steps_metrics_keeps(tmp_path):
    a, b, c = _recipe(tmp_path), _recipe(tmp_path, "optim.lr=5e-4"), _recipe(tmp_path, "optim.lr=1e-4")
    record_start(tmp_path, a, decide(a, None, None, tmp_path))
    record_start(tmp_path, b, decide(b, "step_00000004", a.to_dict(), tmp_path))
    assert [(r["first_step"], r["changed"]) for r in read_history(tmp_path)] == [
        (1, {}), (5, {"optim.lr": [1e-3, 5e-4]})]
    assert recipe_of_step(tmp_path, 4)["optim"]["lr"] == 1e-3 and recipe_of_step(tmp_path, 5)["optim"]["lr"] == 5e-4
    # b crashed before its first checkpoint; the run starts again from step 4 with c: b's row goes
    record_start(tmp_path, c, decide(c, "step_00000004", a.to_dict(), tmp_path))
    assert [(r["first_step"], r["recipe"]["optim"]["lr"]) for r in read_history(tmp_path)] == [(1, 1e-3), (5, 1e-4)]
    assert yaml.safe_load((tmp_path / "recipe.yaml").read_text())["optim"]["lr"] == 1e-4
    # the same recipe from a later checkpoint: no new row; an older run without a history gets its first row
    record_start(tmp_path, c, decide(c, "step_00000008", c.to_dict(), tmp_path))
    assert len(read_history(tmp_path)) == 2
    (tmp_path / HISTORY).unlink()
    record_start(tmp_path, c, decide(c, "step_00000008", a.to_dict(), tmp_path))
    rows = [json.loads(line) for line in (tmp_path / HISTORY).read_text().splitlines()]
    assert [(r["first_step"], r["recipe"]["optim"]["lr"]) for r in rows] == [(1, 1e-3), (9, 1e-4)]


def test_every_recipe_key_has_a_resume_policy():
    """A key added to the recipe must be classified (resumable or refused) in recipes.reliability.resume_policy;
    an unclassified one is refused, which would turn a harmless change into a refusal."""
    import dataclasses

    from recipes.config import Recipe

    from recipes.sections import LoraSection
    from recipes.reliability.resume_policy import POLICY, classify

    def leaves(value, path=""):
        if dataclasses.is_dataclass(value):
            for f in dataclasses.fields(value):
                yield from leaves(getattr(value, f.name), f"{path}.{f.name}" if path else f.name)
        else:
            yield path

    recipe = Recipe()
    recipe.model.lora = LoraSection()
    for key in leaves(recipe):
        parts = key.split(".")
        assert any(".".join(parts[:n]) in POLICY for n in range(len(parts), 0, -1)), f"{key}: not in POLICY"
    assert classify("model.lora.r")[0] == "refused" and classify("model.lora.dropout")[0] == "training"
    assert classify("loss.objective.terms.smmd.weight")[0] == "training" and classify("no.such")[0] == "refused"


def test_the_stage_deepspeed_runs_is_what_a_resume_compares():
    from recipes.reliability.resume_policy import _engine_views, recipe_changes

    saved = {"deepspeed": {"zero_stage": 3, "overrides": {}}}
    by_override = {"deepspeed": {"zero_stage": 3, "overrides": {"zero_optimization": {"stage": 2, "overlap_comm": False}}}}
    changes = recipe_changes(_engine_views(saved), _engine_views(by_override))
    assert [(c.key, c.old, c.new, c.kind) for c in changes] == [
        ("deepspeed.overrides.zero_optimization", "(absent)", {"overlap_comm": False}, "run"),
        ("deepspeed.zero_stage", 3, 2, "refused")]
    moved = {"deepspeed": {"zero_stage": 2, "overrides": {}}}  # the same stage 2, written in the section
    assert recipe_changes(_engine_views({"deepspeed": {"zero_stage": 3, "overrides": {
        "zero_optimization": {"stage": 2}}}}), _engine_views(moved)) == []


def test_the_global_batch_is_compared_across_layouts_and_splits():
    from types import SimpleNamespace

    from recipes.reliability.resume_policy import global_batch_problem

    saved = {"train": {"micro_batch_size": 2, "grad_accum": 2}}  # on 2 data-parallel ranks: 8 rows

    def recipe(micro, accum):
        return SimpleNamespace(train=SimpleNamespace(micro_batch_size=micro, grad_accum=accum))

    assert global_batch_problem(recipe(1, 4), saved, 2, 2, "ckpt") is None  # another split of the same 8
    assert global_batch_problem(recipe(2, 1), saved, 2, 4, "ckpt") is None  # 4 ranks x 2: the same 8
    assert global_batch_problem(recipe(2, 2), saved, None, 4, "ckpt") is None  # the layout not recorded
    problem = global_batch_problem(recipe(2, 2), saved, 2, 4, "ckpt")  # 16 rows
    assert "= 16 rows, the checkpoint trained with 2 x 2 x 2 = 8" in problem
    assert "e.g. train.micro_batch_size=2 train.grad_accum=1 on these 4 data-parallel ranks" in problem
    assert "no split reaches 8 rows on 3 data-parallel ranks: resume on 2" in global_batch_problem(
        recipe(1, 1), saved, 2, 3, "ckpt")


# One Python process that runs `recipes.train.main` (what `python -m recipes.train` runs) once per request,
# each with its own stdout and stderr and its exit status: a start that ends before any engine is built
# costs a few hundred milliseconds here, where a process of its own pays ~10 s of imports first. Each
# request gets a port of its own for its world-of-one group, as a process of its own would.
STARTS_DRIVER = r"""
import contextlib, io, json, os, sys, traceback
import recipes.train
MARK = "[numloss-test-start] "
for line in sys.stdin:
    argv = json.loads(line)
    os.environ.pop("MASTER_PORT", None)
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            recipes.train.main(argv)
        except SystemExit as stop:
            code = 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
    sys.__stdout__.write(MARK + json.dumps([code, out.getvalue(), err.getvalue()]) + "\n")
    sys.__stdout__.flush()
"""


class Starts:
    """`recipes.train` starts that end before any engine is built (refused, or finished: nothing to do),
    each a call of `recipes.train.main` in one long-lived process (STARTS_DRIVER); the same exit status,
    stdout and stderr as a process of its own. A start that would build an engine belongs in `run_in_ranks`."""

    def __init__(self):
        import queue
        import threading

        env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-c", STARTS_DRIVER], cwd=REPO, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(x) for x in self.proc.stdout] + [self.lines.put("")],
                         daemon=True).start()

    def __call__(self, recipe: Path, out: Path, *overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
        import queue

        argv = [str(recipe), f"train.out_dir={out}", *overrides]
        self.proc.stdin.write(json.dumps(argv) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while True:  # lines a library writes to the process's own stdout are not the answer
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no answer in {timeout} s to the start {argv}") from None
            assert line, f"the start process ended (exit {self.proc.wait(timeout=30)}) on {argv}"
            if line.startswith("[numloss-test-start] "):
                code, stdout, stderr = json.loads(line[len("[numloss-test-start] "):])
                return subprocess.CompletedProcess(argv, code, stdout, stderr)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def starts():
    pytest.importorskip("deepspeed")
    driver = Starts()
    yield driver
    driver.close()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    pytest.importorskip("deepspeed")
    root = tmp_path_factory.mktemp("refusals")
    recipe = tiny_workspace(root, problems=32, max_digits=2, hidden=32,
                            train={"steps": 2, "micro_batch_size": 2, "save_every": 2, "tensorboard": False,
                                   "export": False})
    out = root / "run"
    run_in_ranks(recipe, out, nproc=1)
    return root, recipe, out


def _written(out: Path) -> dict[str, str]:
    return {name: hashlib.sha256((out / name).read_bytes()).hexdigest()
            for name in ("recipe.yaml", "recipe_history.jsonl", "metrics.jsonl")}


def _refused_before_the_engine(result: subprocess.CompletedProcess, out: Path, before: dict) -> str:
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert "engine deepspeed" not in result.stdout and "resumed" not in result.stdout
    assert _written(out) == before
    return result.stderr


def test_a_global_batch_and_a_zero_stage_the_checkpoint_cannot_take_are_refused_first(run, starts):
    root, recipe, out = run
    before = _written(out)
    more = "train.steps=4"  # a start that would train
    err = _refused_before_the_engine(starts(recipe, out, more, "train.micro_batch_size=4"), out, before)
    assert ("its global batch is train.micro_batch_size 4 x train.grad_accum 1 x 1 data-parallel ranks = 4 rows, "
            "the checkpoint trained with 2 x 1 x 1 = 2") in err, err[-3000:]
    assert "e.g. train.micro_batch_size=2 train.grad_accum=1" in err

    # a stage the overrides set against deepspeed.zero_stage is refused when the recipe loads (the engine
    # decides by the key); a stage changed in the key (and the overrides), by the checkpoint's layout
    err = _refused_before_the_engine(
        starts(recipe, out, more, "deepspeed.overrides={zero_optimization: {stage: 2}}"), out, before)
    assert "deepspeed.overrides.zero_optimization.stage: 2 contradicts deepspeed.zero_stage: 3" in err, err[-3000:]
    err = _refused_before_the_engine(starts(recipe, out, more, "deepspeed.zero_stage=2",
                                            "deepspeed.overrides={zero_optimization: {stage: 2}}"), out, before)
    assert "deepspeed.zero_stage: " in err and "was saved with zero_stage=3; this run has 2" in err, err[-3000:]

    # the same global batch split otherwise, and the same stage written in the overrides: accepted (the run
    # is finished: nothing to do)
    same = starts(recipe, out, "train.micro_batch_size=1", "train.grad_accum=2",
                  "deepspeed.overrides={zero_optimization: {stage: 3}}")
    assert same.returncode == 0 and "already finished" in same.stdout, same.stdout[-2000:] + same.stderr[-3000:]


def test_a_damaged_shard_is_named_before_the_engine_and_before_anything_is_rewritten(run, starts):
    root, recipe, out = run
    before = _written(out)
    shard = sorted((root / "data").glob("shard-*.parquet"))[0]
    original = shard.read_bytes()
    try:
        shard.write_bytes(original[:-10])  # truncated
        err = _refused_before_the_engine(starts(recipe, out, "train.steps=4"), out, before)
        assert f"data.train: {shard}: {len(original) - 10} bytes, the manifest records {len(original)}" in err, err[-3000:]

        damaged = bytearray(original)
        damaged[len(damaged) // 2] ^= 0xFF  # the same size: only the sha256 tells
        shard.write_bytes(bytes(damaged))
        err = _refused_before_the_engine(starts(recipe, out, "train.steps=4", "data.verify=full"), out, before)
        assert f"data.train: {shard}: its sha256 differs from the manifest's" in err, err[-3000:]
    finally:
        shard.write_bytes(original)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    pytest.importorskip("deepspeed")
    root = tmp_path_factory.mktemp("resume")
    recipe = tiny_workspace(root, problems=32, max_digits=2, hidden=32,
                            optim={"lr": LR, "warmup_steps": WARMUP, "min_lr_ratio": FLOOR},
                            train={"steps": 6, "micro_batch_size": 2, "save_every": 2, "keep_last": 1,
                                   "tensorboard": False})
    save_tiny_llama(root / "tok", root / "model", hidden=32)  # a checkpoint the Megatron engine converts
    data = yaml.safe_load(recipe.read_text())
    data["model"] = {"name_or_path": str(root / "model"), "dtype": "float32"}
    recipe.write_text(yaml.safe_dump(data))
    return root, recipe


def cosine_lr(lr: float, step: int, total: int) -> float:
    """The lr optimizer step `step` (1-based) runs at after the warmup: cosine from `lr` to FLOOR x lr."""
    progress = (step - 1 - WARMUP) / (total - WARMUP)
    return lr * (FLOOR + (1 - FLOOR) * 0.5 * (1 + math.cos(math.pi * progress)))


def _run(proc) -> tuple[int, str]:
    output, _ = proc.communicate(timeout=600)
    return proc.returncode, output


def _digest(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_deepspeed_a_failed_save_loses_nothing_and_a_changed_recipe_applies_from_the_resume_step(workspace, starts):
    root, recipe = workspace
    out, checkpoints = root / "deepspeed", root / "deepspeed" / "checkpoints"

    # 1. a full disk under rank 1 at step 4's save
    code, output = _run(launch(recipe, out, site=DISK_FULL, env={"NUMLOSS_TEST_DISK_FULL": "1:4"}))
    assert code != 0 and "exitcode  : 74" in output, output[-4000:]
    failed = checkpoints / ".step_00000004.partial" / "zero_pp_rank_1_mp_rank_00_model_states.pt"  # DeepSpeed's write
    assert f"checkpoint step 4 was not saved: rank 1 could not write {failed} (the disk is full: OSError: [Errno 28] No space" in output
    assert " GiB free of " in output and f"on that filesystem ({checkpoints / '.step_00000004.partial'})" in output
    assert "rank 0 could not" not in output and "`latest` names step_00000002" in output
    assert (checkpoints / "latest").read_text() == "step_00000002"
    assert sorted(p.name for p in checkpoints.glob("*step_*")) == ["step_00000002"]

    # 2. the same command, saving every step: resumes from step 2, keep_last 1 leaves the newest alone
    output = run_in_ranks(recipe, out, "train.save_every=1")  # (numbers and what it says: pre-started ranks)
    assert "resumed tiny from step 2" in output and "train.save_every: 2 -> 1" in output
    assert sorted(p.name for p in checkpoints.glob("*step_*")) == ["step_00000006"]
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 7))
    final_before = _digest(out / "final")

    # 3. more steps, a 10x lower lr and another SMMD weight on resume
    changed = ("train.save_every=1", "train.steps=8", f"optim.lr={LOW}",
               "loss.objective={terms: {smmd: {weight: 1.0}}}")
    output = run_in_ranks(recipe, out, *changed)
    assert "resumed tiny from step 6" in output
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert rows[6]["lr"] == pytest.approx(cosine_lr(LOW, 7, 8), rel=1e-12)  # 9.75e-5
    assert rows[5]["lr"] == pytest.approx(cosine_lr(LR, 6, 6), rel=1e-12)
    assert rows[6]["recipe_changed"] == {"optim.lr": [LR, LOW], "train.steps": [6, 8],
                                         "loss.objective.terms.smmd.weight": [3.0, 1.0]}
    assert rows[2]["recipe_changed"] == {"train.save_every": [2, 1]}  # step 2's resume
    assert [r["step"] for r in rows if "recipe_changed" in r] == [3, 7]
    for row, weight in ((rows[5], 3.0), (rows[6], 1.0), (rows[7], 1.0)):  # the weight trains from step 7
        assert row["loss"] == pytest.approx(row["ce"] + weight * row["term/smmd"], rel=1e-5)
    assert (f"in effect from step 7 (recorded in {out / 'recipe_history.jsonl'}): "
            "loss.objective.terms.smmd.weight: 3.0 -> 1.0; optim.lr: 0.003 -> 0.0003; train.steps: 6 -> 8") in output
    assert f"lr of step 7: {cosine_lr(LOW, 7, 8):.6g} (the checkpoint's recipe would have run it at " in output
    history = [json.loads(line) for line in (out / "recipe_history.jsonl").read_text().splitlines()]
    assert [(h["first_step"], h["checkpoint"]) for h in history] == [(1, None), (3, "step_00000002"),
                                                                       (7, "step_00000006")]
    assert history[1]["changed"] == {"train.save_every": [2, 1]}
    assert history[2]["changed"]["optim.lr"] == [LR, LOW] and history[2]["recipe"]["optim"]["lr"] == LOW
    assert history[0]["recipe"]["optim"]["lr"] == LR and history[0]["recipe"]["train"]["save_every"] == 2
    assert yaml.safe_load((out / "recipe.yaml").read_text())["optim"]["lr"] == LOW
    assert _digest(out / "final") != final_before  # step 8's export

    # 4. the finished run started again (one process: the decision comes before any engine)
    final, recipe_yaml = _digest(out / "final"), (out / "recipe.yaml").read_text()
    again = starts(recipe, out, *changed)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "tiny already finished" in again.stdout and "nothing to do" in again.stdout
    other_lr = starts(recipe, out, *changed[:-2], f"optim.lr={1e-4}", changed[-1])
    assert other_lr.returncode == 2, other_lr.stdout[-2000:] + other_lr.stderr[-3000:]
    assert f"{out} has finished (final/ holds its last step)" in other_lr.stderr
    assert "optim.lr: 0.0003 -> 0.0001" in other_lr.stderr and "raise train.steps" in other_lr.stderr
    seed = starts(recipe, out, *changed[:-3], "train.steps=10", changed[-2], changed[-1], "train.seed=1")
    assert seed.returncode == 2, seed.stdout[-2000:] + seed.stderr[-3000:]
    assert "train.seed: 0 -> 1 (the data order and every rank's random state)" in seed.stderr
    assert "engine deepspeed" not in seed.stdout and "resumed" not in seed.stdout  # refused before the engine
    assert _digest(out / "final") == final and (out / "recipe.yaml").read_text() == recipe_yaml
    assert len((out / "recipe_history.jsonl").read_text().splitlines()) == 3
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 9))


def test_megatron_a_lower_lr_on_resume_runs_from_the_resume_step(workspace):
    root, recipe = workspace
    out = root / "megatron"
    megatron = ("train.engine=megatron", "train.save_every=0", "train.export=false")
    run_in_ranks(recipe, out, *megatron, "train.steps=4", nproc=1)  # numbers and lines: a pre-started rank
    resumed = run_in_ranks(recipe, out, *megatron, "train.steps=6", f"optim.lr={LOW}", nproc=1)
    assert "resumed tiny from step 4" in resumed
    assert "optim.lr: 0.003 -> 0.0003; train.steps: 4 -> 6" in resumed, resumed[-3000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert rows[3]["lr"] == pytest.approx(cosine_lr(LR, 4, 4), rel=1e-12)
    assert rows[4]["lr"] == pytest.approx(cosine_lr(LOW, 5, 6), rel=1e-12)  # 1.65e-4
    assert rows[5]["lr"] == pytest.approx(cosine_lr(LOW, 6, 6), rel=1e-12)
    assert rows[4]["recipe_changed"] == {"optim.lr": [LR, LOW], "train.steps": [4, 6]}
    history = [json.loads(line) for line in (out / "recipe_history.jsonl").read_text().splitlines()]
    assert [h["first_step"] for h in history] == [1, 5]
