"""What a resumed run may change in its recipe, decided before any model is built.

A run resumes from its checkpoint with the recipe it is started with, compared key by key with the
recipe that checkpoint was trained with (its `recipe.json`, `recipes.reliability.checkpoints`). Every key
of the recipe is one of three kinds (`POLICY`, longest prefix first; a key not in it is refused): the
engine-neutral keys are classified here, each engine's section by its contract (`resume_rules`, in
recipes/engines/<engine>/contract.py), which also says how its section is compared (`resume_view`):

- training: what the updates depend on and a user changes on purpose: the optimizer and its schedule
  (`optim.*`: a lower lr after a loss spike, another warmup, schedule or floor), `train.steps`, the
  terms' weights and options (`loss.objective.*`), LoRA's dropout. Applied from the first step after the
  checkpoint: the schedule is re-evaluated for the new recipe at that step in both engines
  (`recipes.training.schedule.apply_recipe_schedule`: the loaded optimizer's hyperparameters and lr are
  the recipe's, its moments the checkpoint's), as Megatron-LM's `--override-opt-param-scheduler` does.
- run: how the run is driven, laid out, logged, saved, evaluated and exported (cadences, `keep_last`,
  timeouts, the micro-batch split of the same global batch, Megatron's TP / PP / SP, kernels,
  `eval.*`, `cluster.*`). Applied from that step too.
- refused: what the checkpoint's weights, optimizer state or data position mean only with: the model,
  tokenizer and dtype, the data and its order (`data.train`, `shuffle_window`, `train.seed`), the
  numeric vocabulary, the engine, ZeRO stage, DeepSpeed's tensor-parallel size, offloading, Megatron's
  optimizer kind, LoRA's shape. Refused (exit 2) naming the key, the old and the new value.

Every accepted change is printed with the step it takes effect, put in that step's metrics.jsonl row
(`recipe_changed`), and recorded in `<out_dir>/recipe_history.jsonl` (`recipes.reliability.recipe_history`).

A finished run (its checkpoint at `train.steps`, and when it exports a `final/` whose record says it holds
that checkpoint: `recipes.reliability.export_writer`) started again with the same recipe, or with changes
of the run kind only, says so and does nothing (exit 0, `final/` untouched); with a training change it is
refused (exit 2): more `train.steps` continues it, another recipe is a new `train.out_dir`. A run that
trained its last step but whose export was stopped or killed (`final/` missing, of an earlier step, or
without a record) is not finished: the same command loads the last checkpoint, trains nothing and exports
it. `train.steps` below the checkpoint's step is refused.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from data_prep.shards import sha256_file
from numloss import ObjectiveConfig
from recipes.config import Recipe
from recipes.engines import ENGINES, engine_contract
from recipes.engines.contract import REFUSED, RUN, TRAINING, ResumeRule

from .checkpoints import MANIFEST, CheckpointDirs, read_latest, tag_step
from .export_writer import clean_leftovers, read_record
from recipes.training.runtime import Runtime
from recipes.training.schedule import Schedule

# dotted key prefix -> (kind, what it is). The longest matching prefix decides; see the module docstring.
# The engine-neutral rows; each engine's section's rows are its contract's (`resume_rules`), added below.
POLICY: dict[str, ResumeRule] = {
    "name": (RUN, "the run's display name"),
    # the model: what the checkpoint's tensors are
    "model.name_or_path": (REFUSED, "the model the weights started from"),
    "model.config": (REFUSED, "the model's architecture"),
    "model.tokenizer": (REFUSED, "the tokenizer: token ids in the data and the checkpoint's embedding rows"),
    "model.dtype": (REFUSED, "the dtype of the weights and the optimizer state"),
    "model.vision": (REFUSED, "the model class"),
    "model.lora": (REFUSED, "the adapters the checkpoint holds (whether, where, rank and scale)"),
    "model.lora.dropout": (TRAINING, "LoRA's dropout"),
    "model.lora.export_merged": (RUN, "what the export writes"),
    "model.attn_implementation": (RUN, "the attention kernel"),
    "model.gradient_checkpointing": (RUN, "activation recomputation"),
    "model.trust_remote_code": (RUN, "a loading permission"),
    # the data: the reader's saved position is a count of samples of one seeded order
    "data.train": (REFUSED, "the training data"),
    "data.shuffle_window": (REFUSED, "the data order"),
    "data.seq_len": (RUN, "the padded length"),
    "data.pad_to_multiple_of": (RUN, "padding"),
    "data.length_bucketing": (RUN, "the order of rows inside each global batch (the same rows per step)"),
    "data.allow_tokenizer_mismatch": (RUN, "a check's strictness"),
    "data.verify": (RUN, "a check's thoroughness"),
    "data.eval": (RUN, "evaluation"),
    # the objective
    "loss.objective": (TRAINING, "the terms, their weights and options"),
    # a change of the objective like the terms' (the list is compared, not the modules' code)
    "loss.plugins": (TRAINING, "the modules that register the user's terms"),
    "loss.numeric_policy": (REFUSED, "the numeric vocabulary the terms score"),
    "loss.numeric_max_value": (REFUSED, "the numeric vocabulary the terms score"),
    "loss.space_variants": (REFUSED, "the numeric vocabulary the terms score"),
    "loss.head": (RUN, "how the logits are computed (the same loss)"),
    "loss.chunk_size": (RUN, "how the logits are computed (the same loss)"),
    "loss.router_aux_coeff": (TRAINING, "the router load-balancing loss's weight"),
    "optim": (TRAINING, "the optimizer's hyperparameters and LR schedule"),
    # the loop
    "train.engine": (REFUSED, "the checkpoint's format"),
    "train.seed": (REFUSED, "the data order and every rank's random state"),
    "train.steps": (TRAINING, "the run's length, and so its LR schedule"),
    "train.micro_batch_size": (RUN, "the split of the global batch (the reader refuses another global batch)"),
    "train.grad_accum": (RUN, "the split of the global batch (the reader refuses another global batch)"),
    "train.global_batch_size": (RUN, "a check of the global batch (the reader refuses another one)"),
    "train.log_every": (RUN, "logging"),
    "train.grad_diagnostics_every": (RUN, "logging"),
    "train.save_every": (RUN, "the checkpoint cadence"),
    "train.keep_last": (RUN, "how many checkpoints are kept"),
    "train.resume_fallback": (RUN, "what a corrupt checkpoint does"),
    "train.max_epochs": (RUN, "a check of the data's repetitions"),
    "train.out_dir": (RUN, "the run directory"),
    "train.export": (RUN, "whether the run exports"),
    "train.dist_timeout_minutes": (RUN, "the collectives' timeout"),
    "train.preempt_window_s": (RUN, "how repeated stop signals are read"),
    "train.watchdog_s": (RUN, "when a silent or stuck rank ends the job"),
    "train.tensorboard": (RUN, "logging"),
    "train.wandb_project": (RUN, "logging"),
    "train.tracking": (RUN, "logging (the trackers keep the run's id: recipes.training.tracking)"),
    "train.progress": (RUN, "logging"),
    "eval": (RUN, "evaluation"),
    "cluster": (RUN, "where and how the run is launched"),
}


def _engine_rules() -> dict[str, ResumeRule]:
    """Every engine's resume rules (`EngineContract.resume_rules`), each key inside its own section."""
    rules: dict[str, ResumeRule] = {}
    for contract in ENGINES.values():
        for key, rule in contract.resume_rules.items():
            if key.split(".")[0] != contract.section:
                raise ValueError(f"{contract.name}'s resume_rules: {key} is not a key of its own section "
                                 f"{contract.section!r}")
            rules[key] = rule
    return rules


POLICY.update(_engine_rules())
UNCLASSIFIED = (REFUSED, "not yet classified as resumable (recipes/reliability/resume_policy.py; an engine's "
                          "section: its contract's resume_rules)")


class ResumeRefused(ValueError):
    """The recipe cannot resume this run directory (exit 2, before any model is built)."""


def classify(key: str) -> tuple[str, str]:
    """(kind, what it is) of a dotted recipe key: its longest prefix in POLICY."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        found = POLICY.get(".".join(parts[:n]))
        if found is not None:
            return found
    return UNCLASSIFIED


ABSENT = "(absent)"


def show(value: Any) -> str:
    return value if value is ABSENT else json.dumps(value, sort_keys=True)


@dataclass
class Change:
    key: str
    old: Any
    new: Any
    kind: str
    why: str

    def describe(self) -> str:
        return f"{self.key}: {show(self.old)} -> {show(self.new)}"


def _sections(cls=Recipe, prefix: str = "") -> set[str]:
    """The dotted paths of the recipe's dataclass sections ("" for the recipe itself). The objective is
    numloss's typed config but a free-form mapping here: a term added or removed is a change."""
    found = {prefix}
    for f in dataclasses.fields(cls):
        for tp in (typing.get_type_hints(cls)[f.name], *typing.get_args(typing.get_type_hints(cls)[f.name])):
            if dataclasses.is_dataclass(tp) and tp is not ObjectiveConfig:
                found |= _sections(tp, f"{prefix}{f.name}.")
    return {s.rstrip(".") for s in found}


SECTIONS = _sections()


def recipe_changes(old: dict, new: dict, path: str = "") -> list[Change]:
    """Every leaf where two recipes (as `Recipe.to_dict()` gives them) differ, classified. A key missing
    from one side of a section (a field added to or removed from the schema since the checkpoint) is
    no change; inside a free-form mapping (`loss.objective`, `model.config`) it is one."""
    if isinstance(old, dict) and isinstance(new, dict):
        found = []
        for key in sorted(set(old) | set(new), key=str):
            where = f"{path}.{key}" if path else str(key)
            if key in old and key in new:
                found += recipe_changes(old[key], new[key], where)
            elif path not in SECTIONS:
                found.append(Change(where, old.get(key, ABSENT), new.get(key, ABSENT), *classify(where)))
        return found
    if old == new or (isinstance(old, (list, tuple)) and isinstance(new, (list, tuple)) and list(old) == list(new)):
        return []
    return [Change(path, old, new, *classify(path))]


def _resolved(recipe: dict, objective: ObjectiveConfig | None = None) -> dict:
    """The recipe (as `Recipe.to_dict()` gives it) with its objective as numloss resolves it (default
    weights filled in, options under `options`), so that `smmd: {}` and `smmd: {weight: 3.0}` are the same
    recipe, and each engine's section as that engine runs it (`_engine_views`: DeepSpeed's ZeRO stage is
    the one in `deepspeed.overrides` where set, as it merges those last). `objective`: the running recipe's,
    typed when it loaded; None: a saved recipe's, read here. A saved objective that no longer resolves (the
    library changed) is compared as written."""
    recipe = _engine_views(recipe)
    if objective is None:
        try:
            objective = ObjectiveConfig.from_dict(recipe.get("loss", {}).get("objective"), root="loss.objective")
        except (ValueError, TypeError):
            return recipe
    return {**recipe, "loss": {**recipe["loss"], "objective": dataclasses.asdict(objective)}}


def _engine_views(recipe: dict) -> dict:
    """The recipe with each engine's section in the form its contract compares (`resume_view`)."""
    views = {contract.section: contract.resume_view(recipe[contract.section]) for contract in ENGINES.values()
             if isinstance(recipe.get(contract.section), dict)}
    return {**recipe, **views}


def global_batch_problem(recipe: Recipe, saved: dict, saved_dp: int | None, data_parallel: int, where: str) -> str | None:
    """Why the recipe's global batch (micro_batch_size x grad_accum x data-parallel ranks) is not the one
    the checkpoint trained with (the reader's position counts samples of one order of global batches: it
    resumes the same global batch only). None when it is, or when the checkpoint does not say."""
    train = saved.get("train") or {}
    if saved_dp is None or "micro_batch_size" not in train or "grad_accum" not in train:
        return None
    old = train["micro_batch_size"] * train["grad_accum"] * saved_dp
    t = recipe.train
    new = t.micro_batch_size * t.grad_accum * data_parallel
    if old == new:
        return None
    if old % data_parallel:
        way = f"no split reaches {old} rows on {data_parallel} data-parallel ranks: resume on {saved_dp}"
    else:
        rows = old // data_parallel
        micro = t.micro_batch_size if rows % t.micro_batch_size == 0 else rows
        way = (f"e.g. train.micro_batch_size={micro} train.grad_accum={rows // micro} on these {data_parallel} "
               f"data-parallel ranks")
    return (f"cannot resume {where} with this recipe: its global batch is train.micro_batch_size "
            f"{t.micro_batch_size} x train.grad_accum {t.grad_accum} x {data_parallel} data-parallel ranks = {new} "
            f"rows, the checkpoint trained with {train['micro_batch_size']} x {train['grad_accum']} x {saved_dp} = "
            f"{old}; the data reader resumes the same global batch only (its position counts samples of one "
            f"order): {way}, or train into a new train.out_dir")


def checkpoint_layout_problems(recipe: Recipe, data_parallel: int, directory: Path, saved: dict) -> list[str]:
    """Why the checkpoint in `directory`, saved at layout `saved` (its layout.json), cannot resume this
    recipe on `data_parallel` data-parallel ranks: another engine saved it, or this engine's contract
    refuses the layout (`resume_problem`)."""
    engine = engine_contract(recipe)
    if not engine.saved_by(saved):
        other = next((name for name, contract in ENGINES.items() if contract.saved_by(saved)), "another")
        return [f"train.engine: {recipe.train.engine}, but the checkpoint this run would resume from, {directory}, was "
                f"saved by the {other} engine, which the other cannot load: resume with train.engine: {other}, or "
                f"train into a new train.out_dir"]
    problem = engine.resume_problem(saved, recipe, data_parallel, directory)
    return [problem] if problem else []


@dataclass
class ResumePlan:
    """What a start does with its run directory: from which checkpoint (`step` 0: none), with which
    accepted changes, or nothing at all (`finished`). Plain data: it crosses ranks in a broadcast."""

    step: int = 0
    tag: str | None = None
    changes: list[Change] = field(default_factory=list)
    finished: bool = False
    message: str = ""  # finished: what to tell the user
    warnings: list[str] = field(default_factory=list)
    old_recipe: dict | None = None
    lr_first_step: tuple[float, float] | None = None  # the lr of step `step + 1`: old recipe, new recipe

    @property
    def first_step(self) -> int:
        return self.step + 1

    def changed(self) -> dict[str, list]:
        """{key: [old, new]} for metrics.jsonl and the history (ABSENT as None)."""
        return {c.key: [None if c.old is ABSENT else c.old, None if c.new is ABSENT else c.new] for c in self.changes}

    def change_lines(self, history: Path) -> list[str]:
        if not self.changes:
            return []
        lines = [f"recipe changed on resume from {self.tag}, in effect from step {self.first_step} (recorded in "
                 f"{history}): " + "; ".join(c.describe() for c in self.changes)]
        if self.lr_first_step is not None and self.lr_first_step[0] != self.lr_first_step[1]:
            old, new = self.lr_first_step
            lines.append(f"lr of step {self.first_step}: {new:.6g} (the checkpoint's recipe would have run it "
                         f"at {old:.6g})")
        return lines


def decide(recipe: Recipe, tag: str | None, saved: dict | None, out: Path, saved_from: str = "",
           data_parallel: int | None = None, saved_layout: dict | None = None) -> ResumePlan:
    """The plan for starting `recipe` in `out` on `data_parallel` data-parallel ranks whose checkpoint to
    resume is `tag`, saved at `saved_layout` (its layout.json; None: unrecorded, not compared) and trained
    with the recipe `saved` (None: not recorded; `saved_from` names where it was read when not the
    checkpoint). Raises ResumeRefused. Local: reads `out/final` and the checkpoint's checkpoint.json."""
    if tag is None:
        return ResumePlan()
    step = tag_step(tag)
    where = f"{out / 'checkpoints' / tag}"
    plan = ResumePlan(step=step, tag=tag, old_recipe=saved)
    if recipe.train.steps < step:
        raise ResumeRefused(f"train.steps: {recipe.train.steps} is below step {step}, where this run's checkpoint "
                            f"{where} is: a shorter run is a new train.out_dir")
    if saved is None:
        plan.warnings.append(f"warning: {where} does not record the recipe it was trained with (saved before "
                             f"recipe.json): changes to the recipe cannot be checked or recorded")
        return plan
    if saved_from:
        plan.warnings.append(f"warning: {where} does not record its recipe; compared with {saved_from}")
    changes = recipe_changes(_resolved(saved), _resolved(recipe.to_dict(), recipe.loss.objective))
    refused = [c for c in changes if c.kind == REFUSED]
    if refused:
        lines = [f"  {c.describe()} ({c.why})" for c in refused]
        raise ResumeRefused(f"cannot resume {where} (step {step}) with this recipe: a resume cannot change what "
                            f"the checkpoint means:\n" + "\n".join(lines)
                            + "\nResume with the old values, or start a new run in another train.out_dir")
    done = step >= recipe.train.steps
    training = [c for c in changes if c.kind == TRAINING and c.key != "train.steps"]
    exported = not recipe.train.export or export_holds(out, tag)
    if done and training:
        state = ("trained all its steps" if not exported else
                 "finished (final/ holds its last step)" if recipe.train.export else "finished")
        raise ResumeRefused(f"{out} has {state}: its checkpoint {tag} is at train.steps = {step}, and this recipe "
                            f"changes how it would train: " + "; ".join(c.describe() for c in training)
                            + f". To train on with it, raise train.steps (the run resumes from step {step}); "
                            f"for another run, use a new train.out_dir")
    if done and not exported:
        plan.warnings.append(f"{recipe.name} trained all {step} steps but is not exported: {export_state(out)}; "
                             f"this start exports {where}")
    if done and exported:
        plan.finished = True
        plan.message = (f"{recipe.name} already finished: {where} is at train.steps = {step}"
                        + (f" and {out / 'final'} holds it" if recipe.train.export else "")
                        + "; nothing to do (raise train.steps to train further)"
                        + (f". Ignored: {'; '.join(c.describe() for c in changes)}" if changes else ""))
        return plan
    if data_parallel is not None:  # a start that loads the checkpoint: the reader takes the same global batch only
        saved_dp = (saved_layout or {}).get("data_parallel")
        problem = global_batch_problem(recipe, saved, saved_dp, data_parallel, f"{where} (step {step})")
        if problem:
            raise ResumeRefused(problem)
    plan.changes = changes
    if changes:
        plan.lr_first_step = (Schedule.of_dict(saved).lr_of_step(step + 1), Schedule.of(recipe).lr_of_step(step + 1))
    return plan


def run_finished(recipe: Recipe, out: Path) -> bool:
    """Whether the run in `out` is finished by the rule of the module docstring, read from its files alone
    (no collective; nothing verified or recovered, which a start of the run does): `latest` names a
    checkpoint at `train.steps` or past it and, when the recipe exports, `final/` records that checkpoint.
    For a caller outside the run (launch.sweep): a run it calls unfinished is started, and that start
    decides (`plan_resume`), exporting a last checkpoint `final/` does not hold."""
    tag, _ = read_latest(out / "checkpoints")
    if tag is None or tag_step(tag) < recipe.train.steps:
        return False
    return not recipe.train.export or export_holds(out, tag)


def export_holds(out: Path, tag: str) -> bool:
    """Whether `out/final` is the export of checkpoint `tag` (its record says so: `export_writer`)."""
    record = read_record(out / "final")
    manifest = out / "checkpoints" / tag / MANIFEST
    return record is not None and record.holds(tag_step(tag), tag, sha256_file(manifest) if manifest.is_file() else None)


def export_state(out: Path) -> str:
    """What `out/final` holds, in words."""
    final = out / "final"
    record = read_record(final)
    if record is not None:
        return f"{final} holds {record.describe()}"
    return f"{final} does not record what it holds" if final.is_dir() else f"there is no {final}"


def plan_resume(recipe: Recipe, dirs: CheckpointDirs, runtime: Runtime, saved_fallback=None) -> ResumePlan:
    """`decide` for this run directory, on rank 0, the same plan on every rank (one broadcast); raises
    ResumeRefused on every rank together. `dirs.resume_tag()` verifies the checkpoint first (a
    collective). `saved_fallback()`: (recipe, where it was read) for a checkpoint without recipe.json."""
    tag = dirs.resume_tag()
    result: list = [None]
    if runtime.is_main:
        if recipe.train.export:  # an export interrupted while switching in: put the previous one back first
            for line in clean_leftovers(Path(recipe.train.out_dir) / "final"):
                print(f"[numloss] {line}", file=sys.stderr, flush=True)
        saved, saved_from = dirs.saved_recipe(), ""
        if tag is not None and saved is None and saved_fallback is not None:
            saved, saved_from = saved_fallback(tag_step(tag))
        try:
            data_parallel = engine_contract(recipe).parallel_dims(recipe, runtime.world_size).dp
            layout = dirs.saved_layout()
            problems = checkpoint_layout_problems(recipe, data_parallel, dirs.root / tag, layout) if layout else []
            if problems:
                raise ResumeRefused("\n".join(problems))
            result = [decide(recipe, tag, saved, Path(recipe.train.out_dir), saved_from, data_parallel, layout)]
        except ResumeRefused as err:
            result = [str(err)]
        if isinstance(result[0], ResumePlan):
            for line in result[0].warnings:
                print(f"[numloss] {line}", file=sys.stderr, flush=True)
    if dist.is_initialized():
        dist.broadcast_object_list(result, src=0)
    if isinstance(result[0], str):
        raise ResumeRefused(result[0])
    return result[0]
