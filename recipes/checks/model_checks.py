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
- Layout, every engine and device: the engine's contract says which layouts the model and the world
  can take (`EngineContract.layout_problems`: recipes.validate exits 2 on these) and which models it
  can train at all (`model_problems`). Megatron needs megatron.tp_size to divide the attention heads,
  the KV heads (query groups) and the MLP's intermediate size, pp_size x virtual_pp_size to divide the
  layers, grad_accum a multiple of pp_size under interleaving, for a mixture-of-experts model
  megatron.ep_size to divide the experts and the data-parallel size and tp the experts' width, sequence
  parallelism whenever tp > 1 (megatron-core builds no MoE layer under TP without it), and a model its
  conversion supports. DeepSpeed's AutoTP splits uneven head counts (DeepSpeed 0.19.8
  `tp_shard.get_shard_size` gives a rank floor or ceil of kv_heads / tp heads), so it needs no
  divisibility; it refuses fewer KV heads than TP ranks under ZeRO-3, and MoE models. With the world
  size known (`recipes.train`): tp (x pp) divides it and train.global_batch_size equals micro_batch_size
  x grad_accum x data-parallel ranks (`ParallelDims.dp`, the contract's `parallel_dims`).
"""

from __future__ import annotations

from recipes.engines import engine_contract
from recipes.planning.backbones import resolve_model_config


def model_config(recipe, offline: bool = False):
    """(transformers config, where it came from, notes): recipes.planning.backbones.resolve_model_config
    (model.config; a local directory; the HF cache; the hub unless offline; the offline table)."""
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


def layout_problems(recipe, cfg, world_size: int | None = None) -> list[str]:
    """Errors, each naming its keys, of the recipe's parallel layout against the model's shape (and,
    with `world_size`, against the world: `recipes.train` knows it, `recipes.validate` checks the
    recipe's cluster section instead), a model the engine cannot train, and the global batch.
    See the module docstring."""
    engine = engine_contract(recipe)
    errors = engine.layout_problems(recipe, cfg, world_size) + engine.model_problems(recipe, cfg)
    t = recipe.train
    if world_size is not None and t.global_batch_size is not None:
        dp = engine.parallel_dims(recipe, world_size).dp
        if t.global_batch_size != t.micro_batch_size * t.grad_accum * dp:
            errors.append(f"train.global_batch_size: {t.global_batch_size} != micro_batch_size {t.micro_batch_size} x "
                          f"grad_accum {t.grad_accum} x {dp} data-parallel ranks (= "
                          f"{t.micro_batch_size * t.grad_accum * dp}) on {world_size} ranks")
    return errors


def parallel_layout_problems(recipe, cfg, world_size: int | None = None) -> list[str]:
    """The layouts the model (or the world) cannot take (`recipes.validate` exits 2 on these, as on a
    recipe that does not load): the engine contract's `layout_problems`."""
    return engine_contract(recipe).layout_problems(recipe, cfg, world_size)
