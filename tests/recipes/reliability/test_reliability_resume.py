"""Issue 38: a run never loses a checkpoint to a failed save, and a changed recipe on resume does what
docs/reliability.md says (recipes.reliability.checkpoints, checkpoint_writes, resume_policy, recipe_history).
Real runs: `recipes.train` on a tiny Llama, DeepSpeed ZeRO-3 on 2 torchrun ranks and Megatron on 1.

DeepSpeed, one run directory, in order:
1. steps 1-6, save_every 2, keep_last 1; rank 1's write of step 4 fails with ENOSPC (a sitecustomize
   makes its torch.save write half the file, then fail). Before: rank 1 raised, rank 0 waited in
   DeepSpeed's closing barrier, and the half-written `step_00000004/` outranked step 2 when pruning by
   name. Now both ranks exit 74 together, the message names the rank, the file, the error and the free
   space; `latest` is step 2 and nothing of step 4 is left.
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
from pathlib import Path

import pytest
import yaml

pytest.importorskip("deepspeed")

from tests.recipes.torchrun_helpers import REPO, launch, read_metrics, save_tiny_llama, tiny_workspace  # noqa: E402

pytestmark = pytest.mark.timeout(900)

DISK_FULL = Path(__file__).resolve().parents[1] / "disk_full"  # its sitecustomize: ENOSPC on one rank's save
LR, LOW, FLOOR, WARMUP = 3e-3, 3e-4, 0.1, 2  # LOW: the 10x lower lr of a resume


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
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


def _one_process(recipe: Path, out: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "recipes.train", str(recipe), f"train.out_dir={out}", *overrides],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _digest(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_deepspeed_a_failed_save_loses_nothing_and_a_changed_recipe_applies_from_the_resume_step(workspace):
    root, recipe = workspace
    out, checkpoints = root / "deepspeed", root / "deepspeed" / "checkpoints"

    # 1. a full disk under rank 1 at step 4's save
    code, output = _run(launch(recipe, out, site=DISK_FULL, env={"NUMLOSS_TEST_DISK_FULL": "1:4"}))
    assert code != 0 and "exitcode  : 74" in output, output[-4000:]
    failed = checkpoints / ".step_00000004.partial" / "zero_pp_rank_1_mp_rank_00_model_states.pt"  # DeepSpeed's write
    assert f"checkpoint step 4 was not saved: rank 1 could not write {failed} (OSError: [Errno 28] No space" in output
    assert " GiB free of " in output and f"on that filesystem ({checkpoints / '.step_00000004.partial'})" in output
    assert "rank 0 could not" not in output and "`latest` names step_00000002" in output
    assert (checkpoints / "latest").read_text() == "step_00000002"
    assert sorted(p.name for p in checkpoints.glob("*step_*")) == ["step_00000002"]

    # 2. the same command, saving every step: resumes from step 2, keep_last 1 leaves the newest alone
    code, output = _run(launch(recipe, out, "train.save_every=1"))
    assert code == 0, output[-4000:]
    assert "resumed tiny from step 2" in output and "train.save_every: 2 -> 1" in output
    assert sorted(p.name for p in checkpoints.glob("*step_*")) == ["step_00000006"]
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 7))
    final_before = _digest(out / "final")

    # 3. more steps, a 10x lower lr and another SMMD weight on resume
    changed = ("train.save_every=1", "train.steps=8", f"optim.lr={LOW}",
               "loss.objective={terms: {smmd: {weight: 1.0}}}")
    code, output = _run(launch(recipe, out, *changed))
    assert code == 0, output[-4000:]
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
    again = _one_process(recipe, out, *changed)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "tiny already finished" in again.stdout and "nothing to do" in again.stdout
    other_lr = _one_process(recipe, out, *changed[:-2], f"optim.lr={1e-4}", changed[-1])
    assert other_lr.returncode == 2, other_lr.stdout[-2000:] + other_lr.stderr[-3000:]
    assert f"{out} has finished (final/ holds its last step)" in other_lr.stderr
    assert "optim.lr: 0.0003 -> 0.0001" in other_lr.stderr and "raise train.steps" in other_lr.stderr
    seed = _one_process(recipe, out, *changed[:-3], "train.steps=10", changed[-2], changed[-1], "train.seed=1")
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
    first = _one_process(recipe, out, *megatron, "train.steps=4")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = _one_process(recipe, out, *megatron, "train.steps=6", f"optim.lr={LOW}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed tiny from step 4" in resumed.stdout
    assert "optim.lr: 0.003 -> 0.0003; train.steps: 4 -> 6" in resumed.stdout, resumed.stdout[-3000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert rows[3]["lr"] == pytest.approx(cosine_lr(LR, 4, 4), rel=1e-12)
    assert rows[4]["lr"] == pytest.approx(cosine_lr(LOW, 5, 6), rel=1e-12)  # 1.65e-4
    assert rows[5]["lr"] == pytest.approx(cosine_lr(LOW, 6, 6), rel=1e-12)
    assert rows[4]["recipe_changed"] == {"optim.lr": [LR, LOW], "train.steps": [4, 6]}
    history = [json.loads(line) for line in (out / "recipe_history.jsonl").read_text().splitlines()]
    assert [h["first_step"] for h in history] == [1, 5]


def test_every_recipe_key_has_a_resume_policy():
    """A key added to the recipe must be classified (resumable or refused) in recipes.reliability.resume_policy;
    an unclassified one is refused, which would turn a harmless change into a refusal."""
    import dataclasses

    from recipes.config import LoraSection, Recipe
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
