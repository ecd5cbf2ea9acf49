"""What the rest of the project asks of a training engine: `EngineContract`, one object per engine in
the registry `recipes.engines.ENGINES`, keyed by `train.engine`.

Config, checks, planning, validation, train, convert and launch ask the recipe's engine through its
contract (`recipes.engines.engine_contract(recipe)`) instead of comparing `train.engine` to a name.
A contract is pure: it reads the recipe (duck-typed, never imported from recipes.config), the model's
config and numbers, and imports no torch, deepspeed or megatron at module level; the engine's runtime
(`build_engine`, `recipes.engines.runtime`) is the only part that does.

Switching engines (`train.engine=megatron` on a DeepSpeed recipe, and back): each engine states what
its own settings ask for in neutral terms (`stated_intents`: an `Intent` per setting that differs from
its default), and the chosen engine's `adopt_settings` maps each intent it has an equivalent for onto
its own keys (a note for the log, said once; the source key is then reset to its default, so the
recipe the run writes says what runs), and refuses, naming the key, each intent that would be lost.
Neither engine reads the other's keys: the intents are the only thing that crosses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from recipes.parallel_dims import ParallelDims

# ---- intents: what a setting asks for, in terms no engine owns -------------------------------------------

TENSOR_PARALLEL = "tensor_parallel"  # int: ranks that split every layer's matrices
PIPELINE_PARALLEL = "pipeline_parallel"  # int: pipeline stages
VIRTUAL_PIPELINE = "virtual_pipeline"  # int: model chunks per pipeline stage (interleaving)
EXPERT_PARALLEL = "expert_parallel"  # int: ranks that split each MoE layer's experts
SEQUENCE_PARALLEL = "sequence_parallel"  # bool: activations split along the sequence inside the TP group
SEQUENCE_SPLIT = "sequence_split"  # int: ranks that split each row's positions (Ulysses' sp, Megatron's CP)
SHARD_OPTIMIZER = "shard_optimizer_state"  # bool: optimizer state (and main gradients) split over DP ranks
RECOMPUTE = "recompute_activations"  # "full" | "selective": activations recomputed in backward
OFFLOAD_OPTIMIZER = "offload_optimizer"  # bool: optimizer state in host memory
OFFLOAD_WEIGHTS = "offload_weights"  # bool: weights in host memory
REDUCE_PRECISION = "gradient_reduce_precision"  # "bf16": gradients summed over ranks in 16 bits
RAW_ENGINE_CONFIG = "raw_engine_config"  # dict: settings passed to the engine's library as they are
ATTENTION_KERNEL = "attention_kernel"  # str: a named attention implementation of the engine's library
LOGITS_HEAD = "logits_head"  # "chunked": the head computed chunk by chunk, no full-vocabulary logits
LAYER_IMPLEMENTATION = "layer_implementation"  # str: which transformer layer implementation / fused kernels
TOKEN_DISPATCH = "moe_token_dispatch"  # str: how MoE tokens travel to their experts
OVERLAP_GRAD_REDUCE = "overlap_grad_reduce"  # bool false: the gradient reduction does not overlap backward
OVERLAP_PARAM_GATHER = "overlap_param_gather"  # bool false: the weight gather does not overlap forward
PRECONVERTED_WEIGHTS = "preconverted_weights"  # str: the backbone's weights already in the engine's format


@dataclass(frozen=True)
class Intent:
    """One setting of a recipe as its engine states it: `what` it asks for (a name above), the neutral
    `value`, the recipe `key` that says it, the value as written (`stated`) and the key's default (the
    value the key takes again once another engine has adopted the intent)."""

    what: str
    value: Any
    key: str
    stated: Any
    default: Any
    engine: str  # the engine whose setting it is


@dataclass(frozen=True)
class Adoption:
    """How an engine adopts an intent: the recipe key it sets and the value for the intent's value
    (`value` None: the intent's value as it is; `key` None: nothing to set, the engine does it its own
    way, said in `note`), or why it cannot (`refuse`: what to use instead, in this engine's own keys;
    `refusal`: the whole message, a template over the intent's fields, when the usual one misleads)."""

    key: str | None = None
    value: Callable[[Any], Any] | None = None
    note: str = ""
    refuse: str | None = None
    refusal: str | None = None


def get_key(recipe, key: str):
    section, name = key.split(".", 1)
    return getattr(getattr(recipe, section), name)


def set_key(recipe, key: str, value) -> None:
    section, name = key.split(".", 1)
    setattr(getattr(recipe, section), name, value)


def adopt(target: str, table: Mapping[str, Adoption], defaults: Mapping[str, Any], intents: list[Intent],
          recipe) -> tuple[list[str], list[str]]:
    """(errors, notes) of adopting `intents` (another engine's) onto engine `target` through `table`
    (intent name -> Adoption; a name not in it has no equivalent). `defaults`: the target's own keys'
    defaults, to tell a key the recipe set from one it left alone: a key the recipe sets itself is the
    target engine's own word and is used as set (said in the note). Mapped keys are written into the
    recipe and the source keys reset to their defaults, after every intent is judged, so a refusal leaves
    the recipe as it was written."""
    errors: list[str] = []
    notes: list[str] = []
    writes: list[tuple[str, Any]] = []
    for intent in intents:
        how = table.get(intent.what)
        said = f"{intent.key}: {intent.stated!r} is the {intent.engine} engine's setting; on {target}"
        if how is None or how.refuse is not None:
            if how is not None and how.refusal is not None:
                errors.append(how.refusal.format(key=intent.key, stated=intent.stated, value=intent.value))
                continue
            instead = how.refuse if how is not None else f"train.engine: {intent.engine}"
            errors.append(f"{intent.key}: {intent.stated!r} is read by the {intent.engine} engine only; this recipe "
                          f"trains on train.engine: {target}, which would ignore it (remove it; instead: {instead})")
            continue
        writes.append((intent.key, intent.default))
        if how.key is None:  # the engine does this its own way: said, nothing to set
            notes.append(f"{said}: {how.note}")
            continue
        mapped = how.value(intent.value) if how.value is not None else intent.value
        current = get_key(recipe, how.key)
        if how.key != intent.key and current != defaults[how.key] and current != mapped:
            notes.append(f"{said} it would set {how.key}: {_yaml(mapped)}; the recipe sets {how.key}: "
                         f"{_yaml(current)}, used as set")
            continue
        notes.append(f"{said} it sets {how.key}: {_yaml(mapped)}" + (f" ({how.note})" if how.note else ""))
        writes.append((how.key, mapped))
    if not errors:
        for key, value in writes:
            set_key(recipe, key, value)
    return errors, notes


def _yaml(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# ---- resume rules: what a resumed run may change (recipes.reliability.resume_policy) ----------------------

# the kinds of a recipe key on resume: what the updates depend on, changed on purpose (applied from the next
# step); how the run is driven and laid out (applied from the next step); what the checkpoint means only
# with (refused, exit 2)
TRAINING, RUN, REFUSED = "training", "run", "refused"
ResumeRule = tuple[str, str]  # (kind, what the key is: said in a refusal)


# ---- the contract --------------------------------------------------------------------------------------


class EngineContract:
    """Everything the project asks of one training engine, answered without torch or the engine's
    library; each engine's contract subclasses it, sets the class attributes and overrides what its
    engine does otherwise than these defaults. Methods take the recipe (a `recipes.config.Recipe`,
    duck-typed) and, where a rule needs the model's shape, its transformers config (`model_cfg`,
    AutoConfig: never the weights)."""

    name: str  # the value of train.engine
    section: str | None = None  # the recipe section it reads (`recipe.<section>`); None: it has none
    Section: type | None = None  # that section's dataclass (its settings and their defaults)
    # `python -m recipes.validate`'s lines of its plan: a module with `add_plan(rep, recipe, cfg, total,
    # largest, *, hw, rows, adapter, moe_imbalance) -> Plan | None` and `layout_line(rep, recipe, cfg) ->
    # (data-parallel size, text)`
    report: Any
    runtime_class: str  # "module:name" of its `recipes.training.engine.Engine` class (recipes.engines.runtime)
    # "module:name" of `convert(recipe, out, tp, pp) -> dict`, which `python -m recipes.convert` runs to make
    # its own weight format once; None: it trains the Hugging Face weights as they are
    converter: str | None = None
    plan: Callable  # (recipe, model_cfg, *, hardware, rows, **options) -> the layout's `recipes.planning.Plan`
    # what a resume may change in its section: {dotted key under `section`: (kind, what it is)}, kind one of
    # TRAINING, RUN, REFUSED; the longest matching key decides (the resume policy merges these with its
    # engine-neutral rows; a key of the section in neither is refused)
    resume_rules: Mapping[str, ResumeRule] = {}
    adoptions: Mapping[str, Adoption] = {}  # how it adopts another engine's intents (intent name -> Adoption)
    adopted_defaults: Mapping[str, Any] = {}  # the defaults of keys outside its section that `adoptions` set

    def __init__(self, registry: Mapping[str, EngineContract]):
        self._registry = registry  # every engine's contract (recipes.engines.ENGINES), for adopt_settings

    def recipe_problems(self, recipe) -> list[str]:
        """Refusals when the recipe loads (`Recipe.validate`; again after `adopt_settings`), each naming its
        key: what this engine cannot train at all (a model kind, a head, LoRA), and settings that contradict
        a key it reads (DeepSpeed's raw overrides)."""
        return []

    def section_problems(self, section) -> list[str]:
        """Errors of this engine's own section, checked for every recipe whichever engine it trains on
        (choices, positive sizes, settings that need another of the section's settings)."""
        return []

    def stated_intents(self, recipe) -> list[Intent]:
        """What this engine's settings ask for, one `Intent` per setting differing from its default
        (its section's keys, and the keys of other sections that only this engine reads)."""
        return []

    def adopt_settings(self, recipe) -> tuple[list[str], list[str]]:
        """(errors, notes): the other engines' `stated_intents` mapped onto this engine's equivalents
        through `adoption_table` (written into the recipe; each note said once in the log) or refused (an
        error naming the key: exit 2), then `after_adoption`'s notes. Call once, before anything reads the
        recipe's layout."""
        intents = [i for name, other in self._registry.items() if name != self.name for i in other.stated_intents(recipe)]
        default = self.Section() if self.Section is not None else None
        own = dataclasses.fields(default) if default is not None else ()
        defaults = {f"{self.section}.{f.name}": getattr(default, f.name) for f in own}
        errors, notes = adopt(self.name, self.adoption_table(intents), {**defaults, **self.adopted_defaults}, intents,
                              recipe)
        if errors:
            return errors, notes
        notes += self.after_adoption(recipe, intents)
        return self.recipe_problems(recipe), notes

    def adoption_table(self, intents: list[Intent]) -> Mapping[str, Adoption]:
        """The adoptions for these intents (`adoptions`, unless one depends on what is asked)."""
        return self.adoptions

    def after_adoption(self, recipe, intents: list[Intent]) -> list[str]:
        """What the adopted intents change beyond their keys, written into the recipe; its notes."""
        return []

    def parallel_dims(self, recipe, world_size: int) -> ParallelDims:
        """The run's layout on `world_size` ranks (its data-parallel size is `.dp`): here data parallel only."""
        return ParallelDims.of(world_size)

    def cluster_world(self, recipe) -> int:
        """The ranks the recipe's cluster section describes (nodes x ranks per node)."""
        return recipe.cluster.nodes * recipe.cluster.ranks_per_node()

    def layout_candidates(self, recipe, model_cfg, *, hardware, rows, global_batch: int, params: tuple[int, int],
                          moe_imbalance: float = 1.0) -> list:
        """Every layout of `global_batch` rows per step it could run on the recipe's cluster that fits
        `hardware.mem_gib`, each a `recipes.planning.plan.Candidate` (recipes.validation.recommend); by
        default none: the recommender does not weigh the engine."""
        return []

    def layout_problems(self, recipe, model_cfg, world_size: int | None = None) -> list[str]:
        """The layouts the model (or, given `world_size`, the world) cannot take, each naming its keys:
        `recipes.validate` exits 2 on these, `recipes.train` refuses them before building anything."""
        return []

    def model_problems(self, recipe, model_cfg) -> list[str]:
        """Models the engine cannot train at all (a family its conversion does not support)."""
        return []

    def start_problems(self, recipe, *, cuda: bool | None, resuming: bool) -> list[str]:
        """What stops the engine from starting this recipe that the recipe alone cannot tell: kernels
        that must import where the run starts (`cuda`: whether its devices are GPUs; None: the run starts
        elsewhere, not judged), files a fresh start reads (not asked when `resuming`)."""
        return []

    def checkpoint_layout(self, recipe, data_parallel: int) -> dict:
        """What a checkpoint records of the layout that saved it (`layout.json`), with the engine's name."""
        return {"engine": self.name, "data_parallel": data_parallel}

    def saved_by(self, saved_layout: dict) -> bool:
        """Whether a checkpoint's `layout.json` was written by this engine."""
        return saved_layout.get("engine") == self.name

    def resume_problem(self, saved: dict, recipe, data_parallel: int, where) -> str | None:
        """Why the checkpoint saved at layout `saved` (in `where`) cannot resume this recipe on
        `data_parallel` data-parallel ranks (None: it can)."""
        return None

    def resume_view(self, section: dict) -> dict:
        """This engine's section of a recipe (a plain dict, as `Recipe.to_dict()` gives it, saved or
        running) in the form a resume compares: the settings the engine runs, where a raw setting of the
        engine's library overrides one of the section's keys (here each setting is its own key)."""
        return section
