"""What the model's config (AutoConfig, never the weights) says a recipe cannot do: run before any model is
built by `recipes.checks.preflight` (so by `recipes.train` on every rank and by `recipes.validate`).

- Positions: the most positions a row may use, `context_limit`: `max_position_embeddings` (or GPT-2's
  `n_positions`, ...); with RoPE scaling (linear, dynamic, yarn, longrope, llama3: any kind with a
  `factor`) the larger of that and factor x `original_max_position_embeddings` (or x
  max_position_embeddings when no original is stated). Transformers writes the extended length into
  max_position_embeddings for Llama-3.1 (131,072 = 16 x its 8,192 original, factor 8) and keeps the
  original for Qwen2.5's YaRN (32,768, factor 4: 131,072): the larger of the two reads both right. Past
  the limit a learned position table indexes out of range, and RoPE runs on positions the model never
  saw nor was scaled for: both are refused.
- Vocabulary: the tokenizer's ids must index the model's embedding and logits (`vocab_size` >= the
  tokenizer's length), as the engines check after building the model.
- Layout, every engine and device: Megatron needs megatron.tp_size to divide the attention heads, the
  KV heads (query groups) and the MLP's intermediate size, pp_size x virtual_pp_size to divide the
  layers, grad_accum a multiple of pp_size under interleaving, and for a mixture-of-experts model
  megatron.ep_size to divide the experts and the data-parallel size world / (tp x pp) and tp the experts'
  width (`megatron_budget.layout_problems`), and sequence parallelism whenever tp > 1 (megatron-core
  builds no MoE layer under TP without it) (`parallel_layout_problems`: recipes.validate exits 2), and
  a model its conversion supports (`recipes.engines.megatron.convert.check_supported`). DeepSpeed's
  AutoTP splits uneven head counts (DeepSpeed 0.19.8 `tp_shard.get_shard_size` gives a rank
  floor or ceil of kv_heads / tp heads), so it needs no divisibility; its one refusal is fewer KV heads
  than TP ranks under ZeRO-3 (`recipes.engines.deepspeed.model.autotp_problem`). With the world size
  known (`recipes.train`): tp (x pp) divides it and train.global_batch_size equals micro_batch_size x
  grad_accum x data-parallel ranks.
"""

from __future__ import annotations


def model_config(recipe, offline: bool = False):
    """(transformers config, where it came from, notes): recipes.planning.backbones.resolve_model_config
    (model.config; a local directory; the HF cache; the hub unless offline; the offline table)."""
    from recipes.planning.backbones import resolve_model_config

    return resolve_model_config(recipe, offline=offline)


def text_config(cfg):
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else (getattr(cfg, "text_config", None) or cfg)


_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def _scalings(text) -> list[dict]:
    params = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    if params and all(isinstance(v, dict) for v in params.values()):  # one per attention type (transformers 5)
        return list(params.values())
    return [params]


def context_limit(cfg) -> tuple[int | None, str]:
    """(the most positions a row may use, how it was found); (None, why) when the config states none.
    See the module docstring."""
    text = text_config(cfg)
    key = next((k for k in _POSITION_KEYS if isinstance(getattr(text, k, None), int)), None)
    if key is None:
        return None, "the model config states no position limit"
    base = int(getattr(text, key))
    best, how = base, f"{key} {base}"
    for params in _scalings(text):
        kind = params.get("rope_type", params.get("type", "default"))
        factor = params.get("factor")
        if kind == "default" or not isinstance(factor, (int, float)) or factor <= 1:
            continue
        original = params.get("original_max_position_embeddings") or base
        scaled = int(factor * original)
        if scaled > best:
            best, how = scaled, f"{kind} RoPE scaling: factor {factor:g} x {original} original positions"
    return best, how


def vocabulary_problems(cfg, tokenizer_length: int | None) -> list[str]:
    vocab = getattr(text_config(cfg), "vocab_size", None)
    if tokenizer_length is None or vocab is None or tokenizer_length <= vocab:
        return []
    return [f"model.tokenizer: {tokenizer_length} tokens, but the model's embedding and logits have vocab_size "
            f"{vocab}: ids from {vocab} on would index past them; use the model's own tokenizer (or a model "
            f"config with vocab_size >= {tokenizer_length})"]


def data_parallel_size(recipe, world_size: int) -> int:
    """Data-parallel ranks of a world: world / tp (DeepSpeed AutoTP) or world / (tp x pp) (Megatron)."""
    if recipe.train.engine == "megatron":
        model_parallel = recipe.megatron.tp_size * recipe.megatron.pp_size
    else:
        model_parallel = recipe.deepspeed.tp_size
    return max(1, world_size // model_parallel)


def layout_problems(recipe, cfg, world_size: int | None = None) -> list[str]:
    """Errors, each naming its keys, of the recipe's parallel layout against the model's shape (and,
    with `world_size`, against the world: `recipes.train` knows it, `recipes.validate` checks the
    recipe's cluster section instead), a model the Megatron engine cannot convert, and the global batch.
    See the module docstring."""
    errors = parallel_layout_problems(recipe, cfg, world_size)
    t = recipe.train
    if recipe.train.engine == "megatron":
        from recipes.engines.megatron.convert import check_supported

        try:
            check_supported(text_config(cfg))
        except NotImplementedError as err:
            errors.append(f"model: the Megatron engine cannot convert this model: {err}")
    if world_size is not None and t.global_batch_size is not None:
        dp = data_parallel_size(recipe, world_size)
        if t.global_batch_size != t.micro_batch_size * t.grad_accum * dp:
            errors.append(f"train.global_batch_size: {t.global_batch_size} != micro_batch_size {t.micro_batch_size} x "
                          f"grad_accum {t.grad_accum} x {dp} data-parallel ranks (= "
                          f"{t.micro_batch_size * t.grad_accum * dp}) on {world_size} ranks")
    return errors


def parallel_layout_problems(recipe, cfg, world_size: int | None = None) -> list[str]:
    """The layouts the model (or the world) cannot take: TP / PP / EP against the heads, KV heads, widths,
    layers and experts (`recipes.validate` exits 2 on these, as on a recipe that does not load)."""
    errors: list[str] = []
    if recipe.train.engine == "megatron":
        errors += _megatron_problems(recipe, cfg, world_size)
    else:
        from recipes.engines.deepspeed.model import autotp_problem

        tp = recipe.deepspeed.tp_size
        if world_size is not None and world_size % tp:
            errors.append(f"deepspeed.tp_size: {tp} does not divide the world of {world_size} ranks")
        problem = autotp_problem(cfg, tp, recipe.deepspeed.zero_stage) if tp > 1 else None
        if problem:
            errors.append(problem)
        if tp > 1:
            errors += _autotp_moe_problem(cfg, tp)
    return errors


def _autotp_moe_problem(cfg, tp: int) -> list[str]:
    """AutoTP on a mixture-of-experts model: the DeepSpeed engine refuses it when it wraps the model
    (recipes.engines.deepspeed.model); said here first, before any model is built."""
    from recipes.planning.moe import MoEShape

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


def _megatron_problems(recipe, cfg, world_size: int | None) -> list[str]:
    from recipes.planning.budget import Shape
    from recipes.planning.megatron_budget import Layout, layout_problems as shape_problems
    from recipes.planning.moe import MoEShape

    mg, errors = recipe.megatron, []
    if world_size is not None:
        if world_size % (mg.tp_size * mg.pp_size):
            errors.append(f"megatron.tp_size x megatron.pp_size: {mg.tp_size} x {mg.pp_size} does not divide the world "
                          f"of {world_size} ranks (data-parallel size = world / (tp x pp))")
        if mg.virtual_pp_size is not None and (mg.pp_size < 2 or mg.virtual_pp_size < 2):
            errors.append(f"megatron.virtual_pp_size: {mg.virtual_pp_size}: interleaving needs megatron.pp_size >= 2 "
                          f"and a value >= 2 (pp_size is {mg.pp_size}); leave it null otherwise")
    try:
        shape, moe = Shape.of(cfg), MoEShape.of(cfg)
    except AttributeError as err:
        return errors + [f"model: the config lacks a layer shape the Megatron layout needs ({err})"]
    except ValueError as err:  # an MoE family the planner does not know
        return errors + [str(err)]
    if moe is not None and mg.tp_size > 1 and not mg.sequence_parallel:
        # megatron-core 0.16.1 refuses it when the MoE layer is built (recipes.engines.megatron.moe):
        # said here, before any model is built, by recipes.validate (exit 2) and recipes.train's preflight
        errors.append(f"megatron.sequence_parallel: an MoE model ({moe.family}, {moe.experts} experts) at "
                      f"megatron.tp_size {mg.tp_size} needs it (megatron-core refuses MoE layers under TP "
                      "without sequence parallelism); set megatron.sequence_parallel=true")
    vpp = mg.virtual_pp_size if mg.virtual_pp_size and mg.virtual_pp_size > 1 else 1
    # data-parallel size = world / (tp x pp) with EP folded in (megatron-core's parallel_state); unknown
    # without the world (recipes.validate checks the cluster's in recipes.planning.megatron_report)
    divides = world_size is not None and world_size % (mg.tp_size * mg.pp_size) == 0
    dp = world_size // (mg.tp_size * mg.pp_size) if divides else mg.ep_size
    layout = Layout(mg.tp_size, mg.pp_size, dp, vpp, mg.sequence_parallel and mg.tp_size > 1, ep=mg.ep_size)
    return errors + shape_problems(shape, layout, recipe.train.grad_accum, moe)
