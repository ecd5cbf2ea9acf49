"""The Megatron-core engine's contract (`recipes.engines.contract.EngineContract`): its recipe section, what
it refuses, the settings it adopts from another engine's section, its layout rules and data-parallel
size, its plan, its checkpoints' resume rules and its converted weights. Pure: no torch, no megatron.

Layout: world = tp x cp x pp x dp, ranks ordered tensor-parallel fastest, then context-parallel (each
row's positions split, `cp_size`), then data-parallel, then pipeline (Megatron's default order), so with ranks ordered by node a TP group stays inside a node. Expert
parallelism (`ep_size`, mixture-of-experts models) is folded into data parallelism as megatron-core
defines it: each group of `ep_size` consecutive data-parallel ranks splits the experts of every MoE
layer, so ep_size divides the data-parallel size; the experts' own tensor-parallel size is tp_size.
"""

from __future__ import annotations

from dataclasses import dataclass

from recipes.engines import contract as c
from recipes.parallel_dims import ParallelDims
from recipes.planning.moe import MoEShape
from recipes.planning.shape import Shape

from . import plan as engine_plan
from . import report as report_lines
from .kernels import TRANSFORMER_IMPLS, plan_kernels, te_missing
from .layout import DIMS_KEYS, parallel_dims, shape_problems
from .support import check_supported, converted_problems

RECOMPUTE = (None, "full", "selective")
DISPATCHERS = ("auto", "alltoall", "allgather")


@dataclass
class MegatronSection:
    """The Megatron-core engine's layout and settings (`train.engine: megatron`): data-parallel size =
    world / (tp x pp); see the module docstring for the rank order and expert parallelism."""

    tp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1  # expert-parallel size: ranks among which each MoE layer's experts are split
    # context parallelism: each row's positions split over cp_size ranks (Transformer Engine's attention)
    cp_size: int = 1
    # auto: "alltoall" on CUDA, "allgather" on CPU (gloo has no all_to_all_single with uneven splits);
    # alltoall | allgather force one (Megatron's moe_token_dispatcher_type). Routing is dropless
    moe_token_dispatcher: str = "auto"
    sequence_parallel: bool = False
    virtual_pp_size: int | None = None  # interleaved 1F1B: model chunks per pipeline rank
    distributed_optimizer: bool = True  # GPUs: Megatron's DistributedOptimizer; CPU: torch AdamW (named in the log)
    overlap_grad_reduce: bool = True  # GPUs only: overlap the DP reduce-scatter with backward
    overlap_param_gather: bool = True  # GPUs only: overlap the param all-gather with the next forward
    recompute: str | None = None  # None | full | selective: activation recomputation (Megatron's names)
    # auto: the Transformer Engine layer spec and its fusions where TE imports on CUDA, else megatron's local
    # spec; local | transformer_engine force one (Megatron-LM's --transformer-impl; kernels.py)
    transformer_impl: str = "auto"
    # a `python -m recipes.convert` output: a fresh run loads its weights (any TP / PP) instead of converting
    # the HF checkpoint on every rank; a resume loads the run's checkpoint and reads neither
    load_converted: str | None = None


def checkpoint_layout(megatron: MegatronSection, data_parallel: int) -> dict:
    """What a Megatron checkpoint records of the layout that saved it (layout.json)."""
    return {"tensor_parallel": megatron.tp_size, "pipeline_parallel": megatron.pp_size, "data_parallel": data_parallel,
            "virtual_pipeline_parallel": megatron.virtual_pp_size, "sequence_parallel": megatron.sequence_parallel,
            "expert_parallel": megatron.ep_size}


# What a resume may change in the megatron section (recipes.reliability.resume_policy): its distributed
# checkpoints reshard onto any layout; the optimizer state's format is fixed
RESUME_RULES: dict[str, c.ResumeRule] = {
    "megatron.distributed_optimizer": (c.REFUSED, "the optimizer state's checkpoint format"),
    "megatron.tp_size": (c.RUN, "the layout (the checkpoint reshards)"),
    "megatron.cp_size": (c.RUN, "the layout (every context-parallel rank holds the same weights)"),
    "megatron.pp_size": (c.RUN, "the layout (the checkpoint reshards)"),
    "megatron.virtual_pp_size": (c.RUN, "the layout (the checkpoint reshards)"),
    "megatron.sequence_parallel": (c.RUN, "the layout"),
    # the experts' checkpoint keys are global expert numbers: a resume at another EP size reshards them
    "megatron.ep_size": (c.RUN, "the layout (the checkpoint reshards the experts)"),
    "megatron.moe_token_dispatcher": (c.RUN, "how tokens reach their experts (the same routing and loss)"),
    "megatron.overlap_grad_reduce": (c.RUN, "communication overlap"),
    "megatron.overlap_param_gather": (c.RUN, "communication overlap"),
    "megatron.recompute": (c.RUN, "activation recomputation"),
    "megatron.transformer_impl": (c.RUN, "the layer kernels"),
    "megatron.load_converted": (c.RUN, "where a fresh run's weights come from (a resume reads the checkpoint)"),
}

# How Megatron adopts another engine's intents (docs/reliability.md, "Settings the engine ignores").
ADOPTIONS = {
    c.TENSOR_PARALLEL: c.Adoption("megatron.tp_size", note="Megatron splits every layer over as many ranks"),
    c.SHARD_OPTIMIZER: c.Adoption("megatron.distributed_optimizer",
                                  note="the distributed optimizer shards the optimizer state and fp32 main "
                                       "weights over the data-parallel ranks; the weights are split by "
                                       "megatron.tp_size / pp_size"),
    c.RECOMPUTE: c.Adoption("megatron.recompute", note="every layer's forward recomputed in backward"),
    c.LOGITS_HEAD: c.Adoption("loss.head", value=lambda _: "logits",
                              note="Megatron computes the objective on GPTModel's vocab-parallel logits, "
                                   "vocabulary / tp columns per rank"),
    c.OFFLOAD_OPTIMIZER: c.Adoption(refuse="the Megatron engine keeps the optimizer on the GPU; more data-parallel "
                                           "ranks (with megatron.distributed_optimizer) or pipeline stages shrink it"),
    c.OFFLOAD_WEIGHTS: c.Adoption(refuse="the Megatron engine keeps the weights on the GPU; megatron.tp_size / "
                                         "pp_size split them"),
    c.REDUCE_PRECISION: c.Adoption(refuse="the Megatron engine reduces gradients in fp32"),
    c.RAW_ENGINE_CONFIG: c.Adoption(refuse="the megatron section's own settings"),
    c.SEQUENCE_SPLIT: c.Adoption("megatron.cp_size", note="context parallelism splits each row's positions over as "
                                                          "many ranks"),
    c.ATTENTION_KERNEL: c.Adoption(refuse="remove the setting", refusal=(
        "{key}: {stated!r} is a Hugging Face attention kernel; the Megatron engine runs Megatron-core's own "
        "attention: remove the setting")),
}


def split_for_logits(recipe) -> list[str]:
    """The chunked head's intent on Megatron: its logits exist for one micro-batch at a time, so a micro-batch
    holds at most `loss.chunk_size` tokens' rows (chunk_size // data.seq_len rows; 1 when data.seq_len is
    unset) and grad_accum grows by the same factor: the step trains on the same rows, its loss normalised
    over the same global batch (recipes.training.parallel), equal up to float summation order. Writes the
    split into the recipe; returns its note (none when the micro-batch already fits)."""
    t, seq = recipe.train, recipe.data.seq_len
    rows = max(1, recipe.loss.chunk_size // seq) if seq else 1
    micro = max(d for d in range(1, t.micro_batch_size + 1) if t.micro_batch_size % d == 0 and d <= rows)
    if micro == t.micro_batch_size:
        return []
    factor = t.micro_batch_size // micro
    note = (f"loss.head: 'chunked' kept at most loss.chunk_size {recipe.loss.chunk_size} tokens' logits at once; on "
            f"megatron it sets train.micro_batch_size: {micro} (was {t.micro_batch_size}) and train.grad_accum: "
            f"{t.grad_accum * factor} (was {t.grad_accum}): rows of "
            f"{f'data.seq_len {seq} tokens' if seq else 'unknown length (no data.seq_len): one a micro-batch'}, "
            f"the same rows per step")
    t.micro_batch_size, t.grad_accum = micro, t.grad_accum * factor
    return [note]


def context_parallel_problems(megatron, *, cuda: bool | None, te_missing=te_missing) -> list[str]:
    """`megatron.cp_size` > 1, refused before any model is built. megatron-core 0.16.1 runs context
    parallelism through Transformer Engine's attention only (its local spec's DotProductAttention asserts
    cp 1), with packed rows as THD sequences; where TE does not import (a CPU machine, or `cuda` False) the
    refusal names both. Where TE imports the engine still refuses: its CP model path (TE's context-parallel
    attention, the load-balanced split of each batch, counts over data x context parallel) is not built;
    the layout (`ParallelDims.cp`) and the loss's side (`numloss.sequence_split`, load-balanced order) are.
    `cuda` None (the start is elsewhere: `recipes.validate`): nothing said."""
    cp = megatron.cp_size
    if cp == 1 or cuda is None:
        return []
    missing = "CUDA is not available" if not cuda else te_missing()
    if missing is not None:
        return [f"megatron.cp_size: {cp} needs Transformer Engine's context-parallel attention (megatron-core 0.16.1 "
                f"runs context parallelism only through Transformer Engine), and {missing} here: install "
                "transformer_engine on a GPU machine, set megatron.cp_size: 1, or split rows with train.engine: "
                "deepspeed and deepspeed.sp_size"]
    return [f"megatron.cp_size: {cp}: the engine's context-parallel model path (Transformer Engine's attention, THD "
            "packing split over the CP ranks) is not built in this version; set megatron.cp_size: 1, or split "
            "rows with train.engine: deepspeed and deepspeed.sp_size"]


class MegatronContract(c.EngineContract):
    """`EngineContract` for `train.engine: megatron` (see the module docstring)."""

    name = "megatron"
    section = "megatron"
    Section = MegatronSection
    report = report_lines
    runtime_class = "recipes.engines.megatron.runtime.engine:MegatronEngine"
    # HF safetensors -> a megatron-core distributed checkpoint, loaded at any layout (megatron.load_converted)
    converter = "recipes.engines.megatron.runtime.converted:convert_backbone"
    plan = staticmethod(engine_plan.plan)
    layout_candidates = staticmethod(engine_plan.layout_candidates)
    resume_rules = RESUME_RULES  # its distributed checkpoints reshard onto any TP / PP / DP / EP layout
    adoptions = ADOPTIONS
    adopted_defaults = {"loss.head": "logits"}

    # ---- the recipe ----

    def recipe_problems(self, recipe) -> list[str]:
        if recipe.model.vision:
            return ["model.vision: the Megatron engine trains text models (GPTModel)"]
        if recipe.model.lora is not None:
            return ["model.lora is not supported with train.engine: megatron (use another train.engine)"]
        return []

    def section_problems(self, mg: MegatronSection) -> list[str]:
        errors = []
        for key, value, allowed in (("megatron.recompute", mg.recompute, RECOMPUTE),
                                    ("megatron.transformer_impl", mg.transformer_impl, TRANSFORMER_IMPLS),
                                    ("megatron.moe_token_dispatcher", mg.moe_token_dispatcher, DISPATCHERS)):
            if value not in allowed:
                errors.append(f"{key}: {value!r} is not one of {list(allowed)}")
        if mg.sequence_parallel and mg.tp_size == 1:
            errors.append("megatron.sequence_parallel: needs megatron.tp_size > 1")
        for key, value in (("megatron.tp_size", mg.tp_size), ("megatron.pp_size", mg.pp_size),
                           ("megatron.ep_size", mg.ep_size), ("megatron.cp_size", mg.cp_size)):
            if value < 1:
                errors.append(f"{key}: must be >= 1, got {value}")
        return errors

    def stated_intents(self, recipe) -> list[c.Intent]:
        mg, default = recipe.megatron, MegatronSection()
        table = (("tp_size", c.TENSOR_PARALLEL, mg.tp_size), ("pp_size", c.PIPELINE_PARALLEL, mg.pp_size),
                 ("virtual_pp_size", c.VIRTUAL_PIPELINE, mg.virtual_pp_size), ("ep_size", c.EXPERT_PARALLEL, mg.ep_size),
                 ("cp_size", c.SEQUENCE_SPLIT, mg.cp_size),
                 ("sequence_parallel", c.SEQUENCE_PARALLEL, mg.sequence_parallel),
                 ("distributed_optimizer", c.SHARD_OPTIMIZER, mg.distributed_optimizer),
                 ("recompute", c.RECOMPUTE, mg.recompute),
                 ("overlap_grad_reduce", c.OVERLAP_GRAD_REDUCE, mg.overlap_grad_reduce),
                 ("overlap_param_gather", c.OVERLAP_PARAM_GATHER, mg.overlap_param_gather),
                 ("transformer_impl", c.LAYER_IMPLEMENTATION, mg.transformer_impl),
                 ("moe_token_dispatcher", c.TOKEN_DISPATCH, mg.moe_token_dispatcher),
                 ("load_converted", c.PRECONVERTED_WEIGHTS, mg.load_converted))
        return [c.Intent(what, value, f"megatron.{name}", value, getattr(default, name), self.name)
                for name, what, value in table if value != getattr(default, name)]

    def after_adoption(self, recipe, intents: list[c.Intent]) -> list[str]:
        return split_for_logits(recipe) if any(i.what == c.LOGITS_HEAD for i in intents) else []

    # ---- the layout ----

    def parallel_dims(self, recipe, world_size: int) -> ParallelDims:
        return parallel_dims(recipe.megatron, world_size)

    def layout_problems(self, recipe, model_cfg, world_size: int | None = None) -> list[str]:
        mg, errors = recipe.megatron, []
        if world_size is not None:
            errors += parallel_dims(mg, world_size).problems({k: DIMS_KEYS[k] for k in ("tp", "pp", "cp")})
            if mg.virtual_pp_size is not None and (mg.pp_size < 2 or mg.virtual_pp_size < 2):
                errors.append(f"megatron.virtual_pp_size: {mg.virtual_pp_size}: interleaving needs megatron.pp_size "
                              f">= 2 and a value >= 2 (pp_size is {mg.pp_size}); leave it null otherwise")
        try:
            shape, moe = Shape.of(model_cfg), MoEShape.of(model_cfg)
        except AttributeError as err:
            return errors + [f"model: the config lacks a layer shape the Megatron layout needs ({err})"]
        except ValueError as err:  # an MoE family the planner does not know
            return errors + [str(err)]
        if moe is not None and mg.tp_size > 1 and not mg.sequence_parallel:
            # megatron-core 0.16.1 refuses it when the MoE layer is built (recipes.engines.megatron.runtime.moe):
            # said here, before any model is built, by recipes.validate (exit 2) and recipes.train's preflight
            errors.append(f"megatron.sequence_parallel: an MoE model ({moe.family}, {moe.experts} experts) at "
                          f"megatron.tp_size {mg.tp_size} needs it (megatron-core refuses MoE layers under TP "
                          "without sequence parallelism); set megatron.sequence_parallel=true")
        vpp = mg.virtual_pp_size if mg.virtual_pp_size and mg.virtual_pp_size > 1 else 1
        # without the world (recipes.validate checks the cluster's instead) the data-parallel size is
        # unknown: taken as ep, so only the rules that need no world are judged here
        divides = world_size is not None and world_size % (mg.tp_size * mg.pp_size) == 0
        world = world_size if divides else mg.tp_size * mg.pp_size * mg.ep_size
        dims = ParallelDims.of(world, tp=mg.tp_size, pp=mg.pp_size, vpp=vpp, sp=mg.sequence_parallel, ep=mg.ep_size)
        return errors + shape_problems(shape, dims, recipe.train.grad_accum, moe)

    def model_problems(self, recipe, model_cfg) -> list[str]:
        text = model_cfg.get_text_config() if hasattr(model_cfg, "get_text_config") else model_cfg
        try:
            check_supported(text)
        except NotImplementedError as err:
            return [f"model: the Megatron engine cannot convert this model: {err}"]
        return []

    def start_problems(self, recipe, *, cuda: bool | None, resuming: bool) -> list[str]:
        """`megatron.transformer_impl: transformer_engine` where TE cannot run (`cuda`: whether the run's
        devices are GPUs, None when the start is not here: `recipes.validate` runs elsewhere), and a
        `megatron.load_converted` directory that is missing, unfinished, or holds another backbone or
        dtype (not asked of a run that is `resuming`: it reads its own checkpoint), and
        `megatron.cp_size` > 1 (`context_parallel_problems`)."""
        problems = context_parallel_problems(recipe.megatron, cuda=cuda)
        if cuda is not None:
            try:
                plan_kernels(recipe.megatron, cuda=cuda)
            except ValueError as err:
                problems.append(str(err))
        if recipe.megatron.load_converted and not resuming:
            problems += converted_problems(recipe)
        return problems

    # ---- checkpoints ----

    def checkpoint_layout(self, recipe, data_parallel: int) -> dict:
        return checkpoint_layout(recipe.megatron, data_parallel)

    def saved_by(self, saved_layout: dict) -> bool:
        return "pipeline_parallel" in saved_layout
