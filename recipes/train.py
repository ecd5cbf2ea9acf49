"""Train a causal LM with the numeric objective, on DeepSpeed or Megatron-core (`train.engine`).

    torchrun --nproc_per_node 8 -m recipes.train recipes/configs/llama3-8b-gsm8k/smmd.yaml [key=value ...]
    python -m recipes.train RECIPE.yaml          # a world of one

One optimizer step = `grad_accum` micro-batches of `micro_batch_size` rows on each data-parallel rank,
G = micro_batch_size x grad_accum x data-parallel ranks rows in all. Layouts compare: step s trains on
samples [s*G, (s+1)*G) of one seeded order whatever the layout (`data_prep.reader`), and its loss is
normalised over the whole global batch (`recipes.training.parallel`), so the same recipe logs the same losses and
gradient norms on 1 rank or 8, with or without accumulation, tensor parallelism or packing.
The run lives in `train.out_dir`: `recipe.yaml` (the resolved recipe in effect), `recipe_history.jsonl`
(every recipe the run trained with, from which step), `metrics.jsonl` (one line per optimizer step),
`tb/` (TensorBoard), `checkpoints/` (the engine's checkpoints + `latest`), `final/` (a Hugging Face
safetensors model, sharded, with its index, its tokenizer or processor, and `numloss_export.json`, the
step and checkpoint it holds: `recipes.reliability.export_writer`).

Batches become model inputs in `recipes.inputs.batches`: packed shards get block-diagonal attention and
per-example positions. Vision-language recipes (`model.vision: true`) load AutoModelForImageTextToText
and its AutoProcessor; each batch's images are expanded into the prompt by `recipes.inputs.vision`, as in
evaluation, and the whole model (tower, projector, language model) trains (DeepSpeed engine only).

Restarts: a run whose `checkpoints/latest` exists resumes from it by itself: model, optimizer, LR
schedule, the data reader's position and the RNG state, so on CPU the resumed loss curve equals the
uninterrupted one to the bit. It may resume onto another number of data-parallel ranks or another
micro-batch x grad_accum split of the same global batch (`recipes.reliability.checkpoints`, and each
engine's own rules: `recipes.engines.*`), and with another lr, schedule, length, term weights, cadences
(`recipes.reliability.resume_policy`: applied from the next step, logged and recorded; what the checkpoint
depends on is refused before any model is built).

Reliability (docs/reliability.md): before anything is built the recipe and its data are checked
(`recipes.checks.preflight`) and `train.out_dir` is locked for this run (`recipes.reliability.run_lock`);
a NaN/inf step stops the run without saving (`recipes.reliability.health`); SIGTERM/SIGUSR1 save the
current step and stop (`recipes.reliability.preemption`), as does the loss of torchrun's agent
(`recipes.reliability.launcher_watch`); checkpoints are checksummed and verified at
resume (`recipes.reliability.checkpoints`); a save that fails on any rank fails on all of them together
(`recipes.reliability.checkpoint_writes`); a rank that stops answering is named and the job ends
(`recipes.reliability.watchdog`). Exit status: 0 done, 2 refused, 3 non-finite, 4 a rank stalled, 74 a
checkpoint could not be written, 75 preempted.

Before step 1 of a run (not of a resume) each term's value against CE on that step's rows at the starting
weights, from the engine's forward without an update; a term more than 5x CE at its weight is named with
the weight that would make it equal CE (`recipes.training.scale_check`), and nothing is refused.

This file is the loop, the same for every engine (`recipes.training.engine.Engine` is what it calls);
its shared parts are in `recipes.training`, the engines in `recipes.engines`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from data_prep.reader import DataError, ShardDataset

from .config import Recipe, load_recipe
from .engines.runtime import build_engine, engine_class
from .inputs.batches import model_inputs
from .checks.preflight import RecipeCheckError, preflight
from .reliability.checkpoints import CheckpointCorrupt, CheckpointDirs, CheckpointSaveFailed, step_tag
from .reliability.export_writer import ExportWriteFailed, export_record
from .training.diagnostics import diagnosed, finish_row, logged
from .training.engine import Engine
from .training.held_out import HeldOut
from .reliability.launcher_watch import watch_launcher
from .reliability.health import NonFiniteTraining, ZeroGradWatch, any_rank, weights_finite
from .training.parallel import reduce_sum
from .reliability.preemption import Preempted, PreemptionWatch, ignore_stop_signals
from .reliability.recipe_history import HISTORY, record_start, saved_recipe_fallback
from .reliability.resume_policy import ResumePlan, ResumeRefused, plan_resume
from .reliability.run_lock import RunLock, RunLocked
from .training.run_log import MetricsLog, nonfinite_keys, progress_bar
from .training.runtime import Runtime, exit_finished, teardown
from .training.scale_check import first_step_scale, scale_advice
from .training.throughput import StepMeter
from .reliability.watchdog import mark_phase, start_watchdog


# Exit status of `python -m recipes.train` (launchers and batch scripts read it):
EXIT_REFUSED = 2  # refused: a recipe, data, run-directory or checkpoint check failed (before training; bad data when read)
EXIT_NONFINITE = 3  # stopped: NaN/inf loss, gradient norm or weights; nothing saved after the last good checkpoint
EXIT_STALLED = 4  # the watchdog named a rank that stopped answering and ended the job; the last checkpoint is intact
EXIT_SAVE_FAILED = 74  # EX_IOERR: a checkpoint or the export could not be written on some rank; `latest` names the
# previous checkpoint (a failed checkpoint) or the one the export was written from; `final/` is as it was
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: SIGTERM/SIGUSR1/PREEMPT: the current step finished and saved; run it again
# raised on every rank together (their collectives agreed on it): a rank that raises one did not leave on its own
STOPPED_TOGETHER = (RecipeCheckError, RunLocked, CheckpointCorrupt, ResumeRefused, NonFiniteTraining, Preempted,
                    CheckpointSaveFailed, ExportWriteFailed)
# padding_ratio in metrics.jsonl: token positions the model ran (padding included) / real tokens, over the global
# batch. Counted from the loop's batches, unless the engine's train_step returns this key: the positions it ran
TOKENS_RUN = "tokens_run"


def batches(dataset: ShardDataset):
    """Endless iteration over epochs; the dataset's own state says where in which epoch. An epoch without
    a batch (fewer rows than one global batch, which `preflight` refuses first) is an error, never a spin."""
    while True:
        empty = True
        for batch in dataset:
            empty = False
            yield batch
        if empty:
            raise RuntimeError(f"{dataset.path}: an epoch of {dataset.num_rows} rows gave no batch "
                               f"(global batch {dataset.global_batch_size})")


@dataclass
class Hooks:
    """Callbacks for an orchestrator (the Ray launcher), called on every rank.

    on_log(row): after each optimizer step, with the row logged to metrics.jsonl (the global batch's values).
    on_checkpoint(step, path): after a checkpoint is complete on every rank and `latest` names it.
    """

    on_log: Callable[[dict], None] | None = None
    on_checkpoint: Callable[[int, Path], None] | None = None


def train(recipe: Recipe, hooks: Hooks | None = None) -> dict:
    """Run (or resume) a recipe; returns the last logged metrics row on rank 0 ({} elsewhere)."""
    runtime = engine_class(recipe).join_process_group(recipe.train.dist_timeout_minutes)
    engine = None
    lock = RunLock(recipe.train.out_dir, runtime.is_main)
    # from here a SIGTERM/SIGUSR1 asks to save and stop (recipes.reliability.preemption), and a rank that stops
    # answering is named and ends the job (recipes.reliability.watchdog)
    preemption = PreemptionWatch(recipe.train.out_dir, runtime.rank, recipe.train.preempt_window_s)
    watchdog = start_watchdog(recipe.train.watchdog_s, runtime.rank, runtime.world_size,
                              Path(recipe.train.out_dir) / "checkpoints", EXIT_STALLED, before_exit=lock.release)
    # torchrun's agent gone (it hosts the store): stop at the next step, saved (recipes.reliability.launcher_watch)
    launcher = watch_launcher(lambda reason: (preemption.ask(reason), watchdog.abandon()), runtime.rank)
    early = ""  # how this rank left before the run finished, on its own (the watchdog's closing beat says it)
    try:
        # ---- reliability: static checks before anything is built or written (recipes.checks.preflight),
        # then one run per out_dir (recipes.reliability.run_lock) ----
        say = (lambda line: print(f"[numloss] {line}", flush=True)) if runtime.is_main else None
        for line in preflight(recipe, runtime.world_size, say=say, cuda=runtime.device.type == "cuda"):
            if runtime.is_main:
                print(f"[numloss] {line}", flush=True)
        note = lock.acquire()
        if note and runtime.is_main:
            print(f"[numloss] {note}", flush=True)
        preemption.clear_stale_file()
        out = Path(recipe.train.out_dir)
        dirs = CheckpointDirs(out / "checkpoints", recipe.train.keep_last, runtime, recipe.train.resume_fallback,
                              recipe=recipe.to_dict())
        # ---- reliability: what this recipe may change on resume, before any model is built
        # (recipes.reliability.resume_policy); recipe.yaml and the history are written once it loaded ----
        plan = plan_resume(recipe, dirs, runtime, saved_recipe_fallback(out))
        if plan.finished:
            if runtime.is_main:
                print(f"[numloss] {plan.message}", flush=True)
            return {}
        if runtime.is_main:
            out.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(recipe.train.seed)
        engine = build_engine(recipe, runtime, dirs)
        return _train(recipe, runtime, engine, dirs, hooks or Hooks(), preemption, plan)
    except STOPPED_TOGETHER:  # every rank raises it together: nobody left early
        raise
    except BaseException as err:  # this rank leaves on its own: the others name it (watchdog, "left")
        if type(err) is RuntimeError or isinstance(err, torch.distributed.DistError):
            watchdog.peer_lost()  # a collective failed: a rank that left or is gone is named, exit 4
        early = _how_it_ended(err)
        raise
    finally:
        if launcher is not None:
            launcher.close()
        watchdog.close(early)
        lock.release()
        teardown(engine)
        preemption.close()  # last: a signal repeated while the ranks shut down is still the same request


def _how_it_ended(err: BaseException) -> str:
    """A rank's early end in words, for the others' watchdog line."""
    if isinstance(err, SystemExit):
        return f"it exited with status {err.code if err.code is not None else 0} (SystemExit)"
    said = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
    return f"{type(err).__name__}{': ' + said if said else ''}"


def _train(recipe: Recipe, runtime: Runtime, engine: Engine, dirs: CheckpointDirs, hooks: Hooks,
           preemption: PreemptionWatch, plan: ResumePlan) -> dict:
    out = Path(recipe.train.out_dir)
    dp = engine.dp
    global_batch = recipe.train.micro_batch_size * recipe.train.grad_accum * dp.size
    dataset = ShardDataset(recipe.data.train, batch_size=recipe.train.micro_batch_size, rank=dp.rank,
                           world_size=dp.size, global_batch_size=global_batch, seed=recipe.train.seed,
                           shuffle=True, drop_last=True,
                           shuffle_window=recipe.data.shuffle_window, seq_len=recipe.data.seq_len,
                           pad_to_multiple_of=recipe.data.pad_to_multiple_of, pad_id=engine.tokenizer.pad_token_id,
                           # preflight hashed every shard before the engine was built ("full"): a stat each here
                           verify="size" if recipe.data.verify == "full" else recipe.data.verify,
                           length_bucketing=recipe.data.length_bucketing)
    step = dirs.load(dataset, engine.load_state)
    first_step = step + 1  # this run's first: no update of this run before it (NonFiniteTraining's advice)
    if step != plan.step:  # the checkpoint the plan compared with is the one loaded
        raise RuntimeError(f"resumed from step {step}, but the resume policy decided on {plan.tag}")
    if preemption.agreed(runtime.device):  # asked while starting (build, load): nothing new to save
        tag = dirs.latest_tag()
        raise Preempted(step, dirs.root / tag if tag else None, preemption.cause, stage="start")
    if runtime.is_main:
        if step:
            print(f"[numloss] resumed {recipe.name} from step {step}", flush=True)
        record_start(out, recipe, plan)  # recipe.yaml, recipe_history.jsonl
        for line in plan.change_lines(out / HISTORY):
            print(f"[numloss] {line}", flush=True)
    if runtime.is_main:
        print(f"[numloss] engine {engine.name}, optimizer {engine.optimizer_name}, layout {engine.layout}", flush=True)
    metrics = MetricsLog(recipe, out, runtime, step)
    progress = progress_bar(recipe, runtime, step)
    meter = StepMeter(recipe, engine, runtime)  # TFLOP/s, MFU, time split, peak memory (training/throughput.py)
    held_out = HeldOut(recipe, engine, runtime.device) if recipe.eval.every else None  # eval.every (training/held_out.py)
    stream = batches(dataset)
    last: dict = {}
    zero_grad = ZeroGradWatch()
    say_scale = step == 0  # each term's scale against CE: a run's first start says it, a resume does not
    try:
        while step < recipe.train.steps:
            mark_phase("data", step + 1)  # where this rank is, for the watchdog (recipes.reliability.watchdog)
            started = time.perf_counter()
            lr = engine.lr()  # the rate this step's update uses
            window, tokens, tokens_run = [], 0, 0
            for _ in range(recipe.train.grad_accum):  # the step's micro-batches, read ahead to count them
                inputs, batch_tokens = model_inputs(next(stream), **engine.batch_options)
                window.append({k: v.to(runtime.device) if torch.is_tensor(v) else v for k, v in inputs.items()})
                tokens += batch_tokens
                tokens_run += int(inputs["input_ids"].numel())  # padding included
            meter.data_read(started)
            mark_phase("train_step", step + 1)
            if say_scale:  # on step 1's own rows at the starting weights, before the first update
                checking = time.perf_counter()
                advice = first_step_scale(recipe, engine, window, runtime.device)  # a collective
                say_scale = advice is None  # None: the engine has no forward without an update: step 1's row says it
                if runtime.is_main:
                    for line in advice or []:
                        print(f"[numloss] {line}", file=sys.stderr, flush=True)
                started += time.perf_counter() - checking  # not part of step 1's time
            sums = engine.train_step(window, diagnostics=diagnosed(recipe, step + 1))
            step += 1
            mark_phase("collective", step)
            # an engine that pads further than the loop's batches (Megatron's pipeline shapes) says so itself
            sums.setdefault(TOKENS_RUN, tokens_run)
            sums["tokens"], sums["model_flops"] = tokens, meter.flops(tokens, window)
            reduced = reduce_sum(sums, runtime.device, dp.group)  # every rank, every step: one small all-reduce
            elapsed = time.perf_counter() - started
            row = {"step": step, **{k: v for k, v in reduced.items() if k not in ("tokens", "model_flops", TOKENS_RUN)},
                   "lr": lr, "grad_norm": engine.grad_norm(), "tokens_per_s": reduced["tokens"] / elapsed,
                   **meter.row(reduced, elapsed)}
            row = finish_row(row, recipe.optim.grad_clip)  # gradient diagnostics: global-batch values
            if say_scale:  # from step 1's logged values, the forward at its starting weights
                if runtime.is_main:
                    for line in scale_advice(recipe, row, "step 1's global batch (its starting weights)"):
                        print(f"[numloss] {line}", file=sys.stderr, flush=True)
                say_scale = False
            # ---- reliability: every rank agrees on non-finite values and on a stop request
            # (recipes.reliability.health, recipes.reliability.preemption): one all-reduce ----
            nonfinite, stop = any_rank([bool(nonfinite_keys(row)), preemption.requested()], runtime.device)
            evaluated = held_out is not None and step % recipe.eval.every == 0 and not nonfinite
            if evaluated:  # the held-out rows, forward only: the training is the same with or without it
                mark_phase("eval", step)
                row.update(held_out.evaluate())
            mark_phase("log", step)
            if plan.changes and step == plan.first_step:  # the first step of a changed recipe is always logged
                row["recipe_changed"] = plan.changed()
            if logged(recipe, step) or nonfinite or "recipe_changed" in row or evaluated:
                row = {**row, **meter.peak_memory()}  # a collective: on logged steps, on every rank
                metrics.log(row)
            if nonfinite:
                raise NonFiniteTraining(step, nonfinite_keys(row) or ["a value on another rank"], dirs.latest_tag(),
                                        before_any_update=step == first_step)
            warning = zero_grad.update(step, row["grad_norm"])
            if warning and runtime.is_main:
                print(f"[numloss] {warning}", file=sys.stderr, flush=True)
            if hooks.on_log is not None:
                hooks.on_log(row)
            last = row if runtime.is_main else {}
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}")
            if recipe.train.save_every and step % recipe.train.save_every == 0 and step < recipe.train.steps:
                _save(dirs, engine, step, dataset, hooks)
                stop = preemption.agreed(runtime.device)  # asked during the save: stop on the step just saved
            if stop and step < recipe.train.steps:  # preempted: this step saved, then out (exit 75)
                if dirs.latest_tag() != step_tag(step):
                    _save(dirs, engine, step, dataset, hooks)
                raise Preempted(step, dirs.root / step_tag(step), preemption.cause)
        meter.summary(out)
        if dirs.latest_tag() != step_tag(step):
            _save(dirs, engine, step, dataset, hooks)
        if recipe.train.export:
            if preemption.agreed(runtime.device):  # asked before the export: it is the next start's
                raise Preempted(step, dirs.root / step_tag(step), preemption.cause, stage="export")
            mark_phase("export", step)
            _check_weights(engine, step, dirs, runtime)
            engine.export(out / "final", export_record(dirs, step, recipe.to_dict(), engine.name))
    finally:
        metrics.close()
        if progress is not None:
            progress.close()
    return last


def _check_weights(engine: Engine, step: int, dirs: CheckpointDirs, runtime: Runtime) -> None:
    """Never save or export non-finite weights (recipes.reliability.health)."""
    if not weights_finite(engine, runtime.device):
        raise NonFiniteTraining(step, ["the weights after the update"], dirs.latest_tag())


def _save(dirs: CheckpointDirs, engine: Engine, step: int, dataset: ShardDataset, hooks: Hooks) -> None:
    mark_phase("save", step)
    _check_weights(engine, step, dirs, dirs.runtime)
    path = dirs.save(step, dataset, lambda directory: engine.save_state(directory, step), engine.layout)
    if hooks.on_checkpoint is not None:
        hooks.on_checkpoint(step, path)


def _say(err: BaseException | str, every_rank: bool = False) -> None:
    """A refusal or stop in one line on stderr: a refusal every rank finds alike (the recipe, its checks, the
    checkpoint) once, on rank 0 (under torchrun N copies of it would bury it); the rest on every rank."""
    if every_rank or os.environ.get("RANK", "0") == "0":
        print(f"[numloss] {err}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if argv else 2)
    try:
        recipe = load_recipe(argv[0], argv[1:])
    except (ValueError, FileNotFoundError) as err:
        _say(err)
        sys.exit(EXIT_REFUSED)
    try:
        last = train(recipe)
    except DataError as err:  # bad data, refused on the rank that read it
        _say(err, every_rank=True)
        sys.exit(EXIT_REFUSED)
    except (RecipeCheckError, RunLocked, CheckpointCorrupt, ResumeRefused) as err:  # refused alike on every rank
        _say(err)
        sys.exit(EXIT_REFUSED)
    except NonFiniteTraining as err:
        _say(err, every_rank=True)
        sys.exit(EXIT_NONFINITE)
    except Preempted as err:  # each rank says what it was asked by
        _say(err, every_rank=True)
        sys.exit(EXIT_PREEMPTED)
    except CheckpointSaveFailed as err:
        _say(err, every_rank=True)
        sys.exit(EXIT_SAVE_FAILED)
    except ExportWriteFailed as err:  # the checkpoint it exports is committed: the next start exports it again
        _say(f"{err}. The checkpoint of the last step is saved: free space and run the same command to write the "
             f"export again", every_rank=True)
        sys.exit(EXIT_SAVE_FAILED)
    finally:
        ignore_stop_signals()  # the run has ended: a repeated SIGTERM while it exits would only make its status -15
    if last:
        print(json.dumps(last), flush=True)


if __name__ == "__main__":
    main()  # a refusal or a failure exits inside, the normal way
    exit_finished()  # recipes.training.runtime: no interpreter finalisation after a finished run
