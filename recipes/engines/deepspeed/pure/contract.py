"""The DeepSpeed engine's contract (`recipes.engines.contract.EngineContract`): its recipe section, what it
refuses, the settings it adopts from another engine's section, its layout rules and data-parallel size,
its plan, and its checkpoints' resume rules. Pure: no torch, no deepspeed.

Layout: AutoTP (`deepspeed.tp_size`) splits every layer over tp consecutive ranks, or DeepSpeed-Ulysses
(`deepspeed.sp_size`, DeepSpeed's `ulysses_sp`) splits each row's positions over sp consecutive ranks
(never both: DeepSpeed's Ulysses groups know no tensor-parallel group); the rest is data parallel,
world / (tp x sp), with ZeRO sharding over every rank. No pipeline or expert parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from recipes.engines import contract as c
from recipes.parallel_dims import ParallelDims
from recipes.planning.moe import MoEShape

from . import plan as engine_plan
from . import report as report_lines
from .config import override_problems


@dataclass
class DeepSpeedSection:
    zero_stage: int = 3
    offload_optimizer: bool = False
    offload_params: bool = False
    tp_size: int = 1  # AutoTP; > 1 shards the lm_head along the vocabulary (vocab_parallel_lm_head)
    # DeepSpeed-Ulysses: each row's positions split over sp_size ranks (attention heads exchanged all-to-all)
    sp_size: int = 1
    # dtype of the gradient reduce-scatter under bf16: fp32 (the default for loss comparisons: the sum of
    # many ranks' gradients is not rounded to bf16's 8-bit mantissa, so a recipe's loss curve does not
    # depend on its layout through that rounding) | bf16 (half the gradient traffic; the rounding then
    # differs with the data-parallel size: compare losses only between runs with the same setting)
    reduce_dtype: str = "fp32"
    # merged last into the generated DeepSpeed config; one that contradicts a key the engine reads is refused
    # when the recipe loads (config.override_problems)
    overrides: dict = field(default_factory=dict)


# the recipe key behind each entry of layout.json, for the messages
_LAYOUT_KEYS = {"tensor_parallel": "deepspeed.tp_size", "zero_stage": "deepspeed.zero_stage", "lora": "model.lora"}
_DIMS_KEYS = {"tp": "deepspeed.tp_size", "cp": "deepspeed.sp_size"}
# attention kernels DeepSpeed's Ulysses wraps (eager builds a dense mask it cannot gather)
ULYSSES_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3")


def ulysses_problems(recipe, model_cfg=None) -> list[str]:
    """Why DeepSpeed-Ulysses cannot split this recipe's rows (empty: it can, or sp_size is 1)."""
    sp = recipe.deepspeed.sp_size
    if sp == 1:
        return []
    problems = []
    if recipe.deepspeed.tp_size > 1:
        problems.append(f"deepspeed.sp_size: {sp} with deepspeed.tp_size {recipe.deepspeed.tp_size}: DeepSpeed's "
                        "Ulysses groups (deepspeed.runtime.sequence_parallel.parallel_state_sp) take every rank as "
                        "sequence x data parallel and know no AutoTP group; use one of the two")
    attention = recipe.model.attn_implementation
    if attention is not None and attention not in ULYSSES_ATTENTION:
        problems.append(f"deepspeed.sp_size: {sp} needs model.attn_implementation in {list(ULYSSES_ATTENTION)} "
                        f"(DeepSpeed-Ulysses wraps those), not {attention!r}")
    zero = (recipe.deepspeed.overrides or {}).get("zero_optimization") or {}
    if recipe.deepspeed.zero_stage == 3 and zero.get("reduce_scatter") is False:
        problems.append(f"deepspeed.sp_size: {sp} with deepspeed.overrides.zero_optimization.reduce_scatter false at "
                        "ZeRO-3: DeepSpeed 0.19.8 then averages some gradient buckets over the data-parallel ranks and "
                        "others over every rank; keep reduce_scatter on")
    if recipe.model.vision:
        problems.append(f"deepspeed.sp_size: {sp} with model.vision: image tokens would be split from their "
                        "pixels; not supported")
    if model_cfg is not None:
        text = getattr(model_cfg, "text_config", None) or model_cfg
        heads = getattr(text, "num_attention_heads", None)
        kv = getattr(text, "num_key_value_heads", None) or heads
        if heads is not None and heads % sp:
            problems.append(f"deepspeed.sp_size: {sp} does not divide the model's {heads} attention heads "
                            "(Ulysses gives each rank heads / sp of them)")
        if kv is not None and kv % sp and sp % kv:
            problems.append(f"deepspeed.sp_size: {sp} and the model's {kv} KV heads: one must divide the other")
        try:
            moe = MoEShape.of(model_cfg)
        except ValueError:
            moe = True
        if moe is not None:
            problems.append(f"deepspeed.sp_size: {sp} on a mixture-of-experts model: its router/aux would be each "
                            "rank's own slice's; not supported (train.engine: megatron splits rows with "
                            "megatron.cp_size)")
    return problems


def autotp_problem(config, tp_size: int, zero_stage: int) -> str | None:
    """Why AutoTP cannot run this model at this layout (None: it can). AutoTP splits attention by KV
    heads: with fewer KV heads than TP ranks, the ranks past the head count hold empty q/k/v shards.
    That is still correct at ZeRO 0-2 (their all-reduce adds zeros; checked on CPU: the loss equals
    TP 1), but ZeRO-3 cannot partition an empty parameter and DeepSpeed 0.19.8 fails at the first
    forward."""
    text = getattr(config, "text_config", None) or config
    kv = getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", None)
    if kv is not None and kv < tp_size and zero_stage == 3:
        return (f"deepspeed.tp_size: the model has {kv} KV heads, fewer than tp_size {tp_size}: AutoTP leaves "
                f"ranks {kv}..{tp_size - 1} without attention heads, which ZeRO-3 cannot partition; use "
                f"deepspeed.zero_stage 2 or tp_size <= {kv}")
    return None


def autotp_moe_problem(cfg, tp: int) -> list[str]:
    """AutoTP on a mixture-of-experts model: the engine refuses it when it wraps the model
    (recipes.engines.deepspeed.runtime.model); said here first, before any model is built."""
    try:
        moe = MoEShape.of(cfg)
    except ValueError as err:  # an MoE family the planner does not know is still an MoE model
        moe, family = True, str(err)
    else:
        family = f"{moe.family}, {moe.experts} experts" if moe is not None else ""
    if moe is None:
        return []
    return [f"deepspeed.tp_size: {tp} on a mixture-of-experts model ({family}): AutoTP is not tested with its"
            " experts and routers; use deepspeed.tp_size 1 (ZeRO shards the experts) or train.engine: megatron"
            " (megatron.ep_size)"]


def run_layout(recipe, data_parallel: int) -> dict:
    """The layout a DeepSpeed run saves in each checkpoint's layout.json and compares at resume."""
    layout = {"data_parallel": data_parallel, "tensor_parallel": recipe.deepspeed.tp_size,
              "zero_stage": recipe.deepspeed.zero_stage}
    if recipe.deepspeed.sp_size > 1:
        layout["sequence_parallel"] = recipe.deepspeed.sp_size
    if recipe.model.lora is not None:
        layout["lora"] = True  # a LoRA checkpoint holds the adapters only: resume LoRA onto LoRA
    return layout


def resume_problem(saved: dict, layout: dict, where) -> str | None:
    """Why a checkpoint saved with layout `saved` cannot resume at `layout` (None: it can, at another
    data-parallel size through the universal conversion). `recipes.checks` asks before any model is
    built; `checkpoints.universal_tag_to_load` again at resume."""
    for key, recipe_key in _LAYOUT_KEYS.items():
        if saved.get(key) != layout.get(key):
            return (f"{recipe_key}: {where} was saved with {key}={saved.get(key)}; this run has {layout.get(key)}: "
                    f"resume with the same {recipe_key}, or train into a new train.out_dir")
    if layout.get("lora") and (saved.get("data_parallel"), saved.get("sequence_parallel")) != (
            layout.get("data_parallel"), layout.get("sequence_parallel")):
        # ds_to_universal expects every parameter in the checkpoint (not run here)
        return (f"model.lora: {where} was saved on {saved.get('data_parallel')} data-parallel ranks; a LoRA run "
                f"resumes onto the same data-parallel size only (this run has {layout.get('data_parallel')}): run "
                f"it on {saved.get('data_parallel')} data-parallel ranks, or train into a new train.out_dir")
    return None


# What a resume may change in the deepspeed section (recipes.reliability.resume_policy). The ZeRO stage is
# compared as DeepSpeed runs it: `resume_view` moves a stage set in the overrides (a recipe saved before
# such overrides were refused at load) onto deepspeed.zero_stage
RESUME_RULES: dict[str, c.ResumeRule] = {
    "deepspeed.zero_stage": (c.REFUSED, "DeepSpeed loads ZeRO state at the stage that saved it; the stage is "
                                        "deepspeed.overrides.zero_optimization.stage where that is set"),
    "deepspeed.tp_size": (c.REFUSED, "DeepSpeed loads AutoTP state at the size that saved it"),
    "deepspeed.sp_size": (c.RUN, "the layout: the weights are whole on every rank; ZeRO state saved over another "
                                 "number of ranks goes through the universal conversion"),
    "deepspeed.offload_optimizer": (c.REFUSED, "where ZeRO keeps the optimizer state (not tested across a resume)"),
    "deepspeed.offload_params": (c.REFUSED, "where ZeRO keeps the parameters (not tested across a resume)"),
    "deepspeed.reduce_dtype": (c.RUN, "the gradient reduction's dtype"),
    "deepspeed.overrides": (c.RUN, "extra DeepSpeed settings (DeepSpeed refuses what it cannot load)"),
}


def resume_view(section: dict) -> dict:
    """The deepspeed section (a dict) with `overrides.zero_optimization.stage`, where set, moved to
    `zero_stage`: DeepSpeed merges the overrides last, so that is the stage it runs."""
    zero = (section.get("overrides") or {}).get("zero_optimization")
    if not isinstance(zero, dict) or "stage" not in zero:
        return section
    rest = {k: v for k, v in zero.items() if k != "stage"}
    overrides = {**section["overrides"], "zero_optimization": rest}
    if not rest:
        del overrides["zero_optimization"]
    return {**section, "zero_stage": zero["stage"], "overrides": overrides}


# How DeepSpeed adopts another engine's intents (docs/reliability.md, "Settings the engine ignores").
ADOPTIONS = {
    c.TENSOR_PARALLEL: c.Adoption("deepspeed.tp_size", note="AutoTP splits every layer over as many ranks"),
    # stated by the other engine only when it differs from its default (sharded): "not sharded" is ZeRO-0
    c.SHARD_OPTIMIZER: c.Adoption("deepspeed.zero_stage", value=lambda shard: 1 if shard else 0,
                                  note="ZeRO-0 replicates the optimizer state, ZeRO-1 shards it"),
    c.RECOMPUTE: c.Adoption(refuse="model.gradient_checkpointing (every layer's forward recomputed: full only)"),
    c.PIPELINE_PARALLEL: c.Adoption(refuse="deepspeed.zero_stage 3 shards the weights over the data-parallel "
                                           "ranks; the DeepSpeed engine has no pipeline stages"),
    c.VIRTUAL_PIPELINE: c.Adoption(refuse="the DeepSpeed engine has no pipeline stages"),
    c.EXPERT_PARALLEL: c.Adoption(refuse="none: the DeepSpeed engine keeps every expert on every rank, and "
                                         "deepspeed.zero_stage 3 shards them with the other weights"),
    c.SEQUENCE_PARALLEL: c.Adoption(refuse="AutoTP keeps each TP rank's activations whole; "
                                           "model.gradient_checkpointing trades compute for activation memory"),
    c.SEQUENCE_SPLIT: c.Adoption("deepspeed.sp_size", note="DeepSpeed-Ulysses splits each row's positions over as "
                                                           "many ranks"),
    c.LAYER_IMPLEMENTATION: c.Adoption(refuse="model.attn_implementation picks the Hugging Face attention kernel"),
    c.TOKEN_DISPATCH: c.Adoption(refuse="the DeepSpeed engine runs the Hugging Face model's own MoE block"),
    c.OVERLAP_GRAD_REDUCE: c.Adoption(refuse="deepspeed.overrides: {zero_optimization: {overlap_comm: false}}"),
    c.OVERLAP_PARAM_GATHER: c.Adoption(refuse="deepspeed.overrides: {zero_optimization: {overlap_comm: false}}"),
    c.PRECONVERTED_WEIGHTS: c.Adoption(note="the DeepSpeed engine reads model.name_or_path's Hugging Face weights, "
                                            "the ones the conversion was made from"),
}


class DeepSpeedContract(c.EngineContract):
    """`EngineContract` for `train.engine: deepspeed` (see the module docstring); any Hugging Face causal LM
    (or image-text model) that transformers builds, from its own checkpoint, on any device."""

    name = "deepspeed"
    section = "deepspeed"
    Section = DeepSpeedSection
    report = report_lines
    runtime_class = "recipes.engines.deepspeed.runtime.engine:DeepSpeedEngine"
    plan = staticmethod(engine_plan.plan)
    layout_candidates = staticmethod(engine_plan.layout_candidates)
    resume_rules = RESUME_RULES
    adoptions = ADOPTIONS
    adopted_defaults = {"model.gradient_checkpointing": False}
    checkpoint_layout = staticmethod(run_layout)
    resume_view = staticmethod(resume_view)

    # ---- the recipe ----

    def recipe_problems(self, recipe) -> list[str]:
        problems = []
        if recipe.model.lora is not None and recipe.deepspeed.tp_size > 1:
            problems.append("model.lora is not supported with deepspeed.tp_size > 1 (AutoTP does not split PEFT's "
                            "adapter layers)")
        problems += ulysses_problems(recipe)
        # asked again after adopt_settings has written the section's keys
        return problems + override_problems(recipe)

    def section_problems(self, ds: DeepSpeedSection) -> list[str]:
        errors = []
        if ds.reduce_dtype not in ("fp32", "bf16"):
            errors.append(f"deepspeed.reduce_dtype: {ds.reduce_dtype!r} is not one of ['fp32', 'bf16']")
        if ds.zero_stage not in (0, 1, 2, 3):
            errors.append(f"deepspeed.zero_stage: {ds.zero_stage} is not 0, 1, 2 or 3")
        if ds.tp_size < 1:
            errors.append(f"deepspeed.tp_size: must be >= 1, got {ds.tp_size}")
        if not isinstance(ds.sp_size, int) or isinstance(ds.sp_size, bool) or ds.sp_size < 1:
            errors.append(f"deepspeed.sp_size: must be an integer >= 1, got {ds.sp_size!r}")
        return errors

    def stated_intents(self, recipe) -> list[c.Intent]:
        ds, default, m = recipe.deepspeed, DeepSpeedSection(), recipe.model
        intents = []

        def state(what, value, key, stated, default_value):
            intents.append(c.Intent(what, value, key, stated, default_value, self.name))

        if ds.zero_stage != default.zero_stage:
            state(c.SHARD_OPTIMIZER, ds.zero_stage >= 1, "deepspeed.zero_stage", ds.zero_stage, default.zero_stage)
        if ds.tp_size != default.tp_size:
            state(c.TENSOR_PARALLEL, ds.tp_size, "deepspeed.tp_size", ds.tp_size, default.tp_size)
        if ds.sp_size != default.sp_size:
            state(c.SEQUENCE_SPLIT, ds.sp_size, "deepspeed.sp_size", ds.sp_size, default.sp_size)
        if ds.offload_optimizer:
            state(c.OFFLOAD_OPTIMIZER, True, "deepspeed.offload_optimizer", True, False)
        if ds.offload_params:
            state(c.OFFLOAD_WEIGHTS, True, "deepspeed.offload_params", True, False)
        if ds.reduce_dtype != default.reduce_dtype:
            state(c.REDUCE_PRECISION, ds.reduce_dtype, "deepspeed.reduce_dtype", ds.reduce_dtype, default.reduce_dtype)
        if ds.overrides:
            state(c.RAW_ENGINE_CONFIG, ds.overrides, "deepspeed.overrides", ds.overrides, {})
        # the model section's settings that only this engine reads
        if m.gradient_checkpointing:
            state(c.RECOMPUTE, "full", "model.gradient_checkpointing", True, False)
        if m.attn_implementation is not None:
            state(c.ATTENTION_KERNEL, m.attn_implementation, "model.attn_implementation", m.attn_implementation, None)
        if recipe.loss.head == "chunked":
            state(c.LOGITS_HEAD, "chunked", "loss.head", "chunked", "logits")
        return intents

    def adoption_table(self, intents: list[c.Intent]) -> dict[str, c.Adoption]:
        """Full recomputation is HF's gradient checkpointing (every decoder layer); selective has none."""
        if next((i.value for i in intents if i.what == c.RECOMPUTE), None) != "full":
            return ADOPTIONS
        return {**ADOPTIONS, c.RECOMPUTE: c.Adoption("model.gradient_checkpointing", value=lambda _: True,
                                                     note="every decoder layer's forward recomputed in backward")}

    # ---- the layout ----

    def parallel_dims(self, recipe, world_size: int) -> ParallelDims:
        return ParallelDims.of(world_size, tp=recipe.deepspeed.tp_size, cp=recipe.deepspeed.sp_size)

    def layout_problems(self, recipe, model_cfg, world_size: int | None = None) -> list[str]:
        errors: list[str] = []
        tp = recipe.deepspeed.tp_size
        if world_size is not None:
            errors += self.parallel_dims(recipe, world_size).problems(_DIMS_KEYS)
        problem = autotp_problem(model_cfg, tp, recipe.deepspeed.zero_stage) if tp > 1 else None
        if problem:
            errors.append(problem)
        if tp > 1:
            errors += autotp_moe_problem(model_cfg, tp)
        return errors + [p for p in ulysses_problems(recipe, model_cfg) if p not in ulysses_problems(recipe)]

    # ---- checkpoints ----

    def saved_by(self, saved_layout: dict) -> bool:
        return "zero_stage" in saved_layout

    def resume_problem(self, saved: dict, recipe, data_parallel: int, where) -> str | None:
        return resume_problem(saved, run_layout(recipe, data_parallel), where)
