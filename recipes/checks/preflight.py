"""What a recipe can get wrong statically, checked before any model is built: by `recipes.validate` (as
report lines) and by `recipes.train` on every rank before its engine starts (`preflight`: one
`RecipeCheckError` listing every error, exit status 2). Only the recipe, the data's manifest, the model's
config (AutoConfig: never the weights), the tokenizer and the run directory are read, so a 70B run is
refused in seconds.

Loading the recipe already refuses bad types, choices, non-finite or negative optimizer settings
(`recipes.config.Recipe.validate`) and bad term weights and options (`numloss.ObjectiveConfig`). Here,
what needs more than one section, the data, the model's config or the run directory:
- settings the engine would ignore: the other engine's settings adopted onto this engine's own with a
  note, or refused naming the key (`recipes.checks.engine_settings`, through the engine's contract);
- what stops the engine from starting (`start_problems`: Megatron's kernels where the run starts, a
  `megatron.load_converted` directory);
- the objective against the numeric vocabulary (`recipes.checks.objective_checks`, each term's registered
  needs): NTIL and DEL need the digits policy, DEL without space variants; and the model's tokenizer must
  write digits as tokens of their own (and for DEL the decimal point too);
- the training data against the run: its manifest exists, its numeric policy is the recipe's, it holds
  at least one global batch (micro_batch_size x grad_accum x data-parallel ranks: fewer rows give an
  epoch of no steps, and the loop would spin on empty epochs), and `train.steps` fit in
  `train.max_epochs` passes when that is given (a warning when the data repeats and it is not);
- the data's tokenizer against the model's: the manifest's tokenizer fingerprint (the sha256 of the
  tokenizer's ids, template and special tokens, `data_prep.tokenize.tokenizer_fingerprint`) must be the
  model tokenizer's (`data.allow_tokenizer_mismatch: true` makes it a warning, for the rare deliberate
  case), and the data's tokenizer may never be larger than the model's (its ids would index past the
  embedding);
- the data's tokens against the recipe and the model, from the manifest's per-shard statistics
  (`recipes.checks.data_checks`: row lengths, data.seq_len, positions, vocabulary, scored labels);
- the model's config against the recipe (`recipes.checks.model_checks`: the tokenizer fits its
  vocabulary; the engine's contract: the parallel layout divides its heads and layers, the world divides
  the layout, the engine can train this model);
- the run directory (`recipes.checks.run_dir_checks`: train.out_dir can be written; the checkpoint it
  would resume from is of this engine and loads at this layout).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from data_prep.reader import shard_problem
from data_prep.shards import MANIFEST, read_manifest
from recipes.checks import data_checks, model_checks, run_dir_checks
from recipes.checks.objective_checks import objective_problems, tokenizer_needs, tokenizer_problems
from recipes.checks.engine_settings import engine_setting_problems
from recipes.engines import engine_contract
from recipes.engines.contract import SEQUENCE_SPLIT
from recipes.reliability.checkpoints import LATEST
from recipes.training.tracking import tracking_problems


class RecipeCheckError(ValueError):
    """The recipe cannot run as it stands; the message lists every error, one per line."""


def model_tokenizer(recipe, offline: bool = False):
    """The model's tokenizer loaded as data_prep loads one (fast, so the fingerprints compare)."""
    from transformers import AutoTokenizer

    source = recipe.model.tokenizer or recipe.model.name_or_path
    return AutoTokenizer.from_pretrained(source, use_fast=True, trust_remote_code=recipe.model.trust_remote_code,
                                         local_files_only=offline)


def tokenizer_identity(tokenizer) -> dict:
    """{"fingerprint", "length"} of a tokenizer, in the manifest's terms."""
    from data_prep.tokenize import tokenizer_fingerprint

    return {"fingerprint": tokenizer_fingerprint(tokenizer), "length": len(tokenizer)}


def data_problems(recipe, manifest: dict, where: str, data_parallel: int,
                  tokenizer: dict | None = None, key: str = "data.train") -> tuple[list[str], list[str], list[str]]:
    """(errors, warnings, notes) of training data `where` (its manifest) for this recipe on
    `data_parallel` data-parallel ranks; `tokenizer`: the model tokenizer's `tokenizer_identity` (None:
    not compared)."""
    errors: list[str] = []
    warnings: list[str] = []
    notes: list[str] = []
    t = recipe.train
    policy = manifest.get("numeric_vocab", {}).get("policy")
    if policy and policy != recipe.loss.numeric_policy:
        errors.append(f"loss.numeric_policy: {recipe.loss.numeric_policy!r} but {where} was built with the "
                      f"{policy!r} policy (its numeric_mask would not match)")
    rows = int(manifest.get("totals", {}).get("rows", 0))
    global_batch = t.micro_batch_size * t.grad_accum * data_parallel
    if rows < global_batch:
        errors.append(f"{key}: {where} holds {rows} rows, fewer than one global batch of {global_batch} "
                      f"(micro_batch_size {t.micro_batch_size} x grad_accum {t.grad_accum} x {data_parallel} "
                      f"data-parallel ranks): no step could ever be taken; use more data or a smaller batch")
    else:
        per_epoch = rows // global_batch  # the reader leaves the last rows mod G out of each epoch
        epochs = t.steps / per_epoch
        notes.append(f"{t.steps} steps x {global_batch} rows = {epochs:.3g} epochs of {rows} rows "
                     f"({per_epoch} steps each)")
        if t.max_epochs is not None and epochs > t.max_epochs + 1e-9:
            errors.append(f"train.steps: {t.steps} steps take {epochs:.3g} passes over {where} ({per_epoch} steps "
                          f"each), more than train.max_epochs {t.max_epochs:g}: lower train.steps to "
                          f"{math.floor(t.max_epochs * per_epoch)} or raise train.max_epochs")
        elif t.max_epochs is None and epochs > 1:
            warnings.append(f"train.steps: {t.steps} steps repeat {where} {epochs:.3g} times; set train.max_epochs "
                            f"to state it (or use more data)")
    split = next((i for i in engine_contract(recipe).stated_intents(recipe) if i.what == SEQUENCE_SPLIT), None)
    if split is not None and manifest.get("packed"):
        # DeepSpeed-Ulysses masks attention by positions alone; Megatron's CP path is not built
        errors.append(f"{split.key}: {split.stated} splits each row's positions over ranks, and {where} holds packed "
                      "rows (several examples a row), whose examples would attend to each other: build the data "
                      f"without --pack-length, or set {split.key}: {split.default}")
    built = manifest.get("tokenizer", {})
    if tokenizer is not None and built.get("fingerprint"):
        mine = tokenizer["fingerprint"]
        if built.get("length") is not None and built["length"] > tokenizer["length"]:
            errors.append(f"{key}: {where} was built with a tokenizer of {built['length']} tokens "
                          f"({built.get('name')!r}); the model's has {tokenizer['length']}: its ids would index "
                          f"past the model's embedding. Rebuild the data with the model's tokenizer")
        elif built["fingerprint"] != mine:
            msg = (f"{key}: {where} was built with another tokenizer ({built.get('name')!r}, fingerprint "
                   f"{built['fingerprint'][:12]}) than the model's (fingerprint {mine[:12]}): the same ids would "
                   f"mean other tokens. Rebuild the data with the model's tokenizer, or set "
                   f"data.allow_tokenizer_mismatch=true if this is deliberate")
            (warnings if recipe.data.allow_tokenizer_mismatch else errors).append(msg)
    return errors, warnings, notes


@dataclass
class Findings:
    """What the static checks found: errors (the run cannot start), warnings, and notes as (key, line)."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[tuple[str, str]] = field(default_factory=list)


def static_checks(recipe, world_size: int | None, data_parallel: int, *, tokenizer: dict | None = None,
                  config=None, offline: bool = False, missing_data_is_error: bool = True, check_model: bool = True,
                  say: Callable[[str], None] | None = None) -> Findings:
    """Every check of the module docstring but the engine settings (`engine_setting_problems`, which
    rewrites the recipe: call it once before). `world_size`: the run's (None: `recipes.validate`, which
    checks the recipe's cluster section instead); `tokenizer`: the model tokenizer's `tokenizer_identity`
    (None: not compared); `config`: the model's config (None: resolved here, `model_checks.model_config`);
    `check_model`: false when the caller already reported that the config cannot be read; `say`: progress
    lines (an old manifest's scan)."""
    found = Findings(errors=objective_problems(recipe) + run_dir_checks.out_dir_problems(recipe))
    if config is None and check_model:
        try:
            config, _, _ = model_checks.model_config(recipe, offline=offline)
        except Exception as err:  # noqa: BLE001  (ValueError, OSError, transformers' own: one line each)
            found.errors.append(f"model: cannot read the model's config: {type(err).__name__}: {err}")
    vocab_size = positions = None
    positions_how = ""
    if config is not None:
        vocab_size = getattr(model_checks.text_config(config), "vocab_size", None)
        positions, positions_how = model_checks.context_limit(config)
        found.errors += model_checks.layout_problems(recipe, config, world_size)
        found.errors += model_checks.vocabulary_problems(config, tokenizer and tokenizer["length"])
    where = recipe.data.train
    manifest = None
    if not (Path(where) / MANIFEST).is_file():
        if missing_data_is_error:
            found.errors.append(f"data.train: {where} is not a data_prep output directory (no {MANIFEST}); "
                                f"build it with python -m data_prep build ... --out {where}")
    else:
        try:
            manifest = read_manifest(where)
        except ValueError as err:  # another schema version (or not JSON): this code cannot read its shards
            found.errors.append(f"data.train: {err}")
    if manifest is not None:
        errors, warnings, notes = data_problems(recipe, manifest, where, data_parallel, tokenizer)
        found.errors += errors
        found.warnings += warnings
        found.notes += [("epochs", n) for n in notes]
        errors, warnings = data_checks.ensure_statistics(manifest, where, say=say)
        found.errors += errors
        found.warnings += warnings
        if not errors:
            found.errors += data_checks.token_problems(recipe, manifest, where, vocab_size=vocab_size,
                                                       positions=positions, positions_how=positions_how)
    found.errors += run_dir_checks.resume_problems(recipe, data_parallel)
    return found


def start_problems(recipe, cuda: bool | None) -> list[str]:
    """What stops the engine from starting that the recipe alone cannot tell (its contract's
    `start_problems`: Megatron's kernels and converted weights). `cuda`: whether the run's devices are
    GPUs, None when the run starts elsewhere (`recipes.validate`); a run that will resume is not asked
    about the files a fresh start reads."""
    resuming = (Path(recipe.train.out_dir) / "checkpoints" / LATEST).is_file()
    return engine_contract(recipe).start_problems(recipe, cuda=cuda, resuming=resuming)


def shard_file_problems(where: str, verify: str) -> list[str]:
    """Every shard of the data at `where` against its manifest in the recipe's `data.verify` mode (sizes,
    or sha256: `data_prep.reader.shard_problem`), here before any model is built or anything written
    (the reader checks the same at open, after the engine)."""
    manifest = read_manifest(where) if (Path(where) / MANIFEST).is_file() else None
    if manifest is None:
        return []
    return [f"data.train: {p}" for shard in manifest["shards"] if (p := shard_problem(where, shard, verify))]


def preflight(recipe, world_size: int, tokenizer=None, say: Callable[[str], None] | None = None,
              cuda: bool = False) -> list[str]:
    """Every static check of the module docstring for a run on `world_size` ranks; raises
    RecipeCheckError listing the errors, returns the warnings (prefixed "warning: ") and notes.
    `tokenizer`: the model's (default: loaded as `model_tokenizer`); `say`: progress lines; `cuda`:
    whether the run's devices are GPUs (`recipes.train` passes its runtime's)."""
    errors, mapped = engine_setting_problems(recipe)
    errors += start_problems(recipe, cuda)
    errors += tracking_problems(recipe)  # W&B / MLflow named but not installed: before any model is built
    if tokenizer is None and ((Path(recipe.data.train) / MANIFEST).is_file() or tokenizer_needs(recipe)):
        tokenizer = model_tokenizer(recipe)
    if tokenizer is not None:  # what the terms need of it (DEL: digit-level, the decimal point)
        errors += tokenizer_problems(recipe, tokenizer)
    found = static_checks(recipe, world_size, engine_contract(recipe).parallel_dims(recipe, world_size).dp,
                          tokenizer=tokenizer_identity(tokenizer) if tokenizer is not None else None, say=say)
    errors += found.errors + shard_file_problems(recipe.data.train, recipe.data.verify)
    if errors:
        raise RecipeCheckError(f"recipe {recipe.name} cannot run ({len(errors)} error"
                               f"{'s' * (len(errors) != 1)}):\n" + "\n".join(f"  {e}" for e in errors))
    return mapped + [f"warning: {w}" for w in found.warnings] + [text for _, text in found.notes]
