"""Settings one engine reads and the other would ignore: refused, or mapped onto the engine's own, and said.

A recipe switched from `train.engine: deepspeed` to `megatron` (or back) keeps sections the new engine
never reads; a run that silently drops a setting trains something other than what the recipe says
(activation recomputation lost: an 80 GB GPU runs out of memory at step 1, or an offloaded optimizer
comes back onto the GPU). Per setting (docs/reliability.md, "Settings the engine ignores"):

- `model.gradient_checkpointing: true` on Megatron is *mapped* onto `megatron.recompute: full` (both
  recompute every layer's forward in backward: HF checkpoints each decoder layer, Megatron's `full` with
  `uniform` method and one layer per checkpoint), with a note; when `megatron.recompute` is set it is
  used as set, and the note says so. Either way `model.gradient_checkpointing` is then false, so the
  recipe the run writes (`recipe.yaml`) says what runs.
- `model.attn_implementation` on Megatron is refused: it names an HF attention kernel; Megatron-core
  runs its own (Transformer Engine's fused attention on GPUs, the local spec on CPU).
- Any other value of the *other* engine's section that differs from its default is refused, naming
  the key: `deepspeed.*` (zero_stage, offload_optimizer, offload_params, reduce_dtype, overrides) under
  Megatron, `megatron.*` under DeepSpeed. Defaults pass, so a recipe written for one engine switches
  with `train.engine=...` as long as it changes nothing the other engine would drop.
- (`deepspeed.tp_size` under Megatron, `model.lora`, `model.vision` and `loss.head: chunked` under
  Megatron are refused when the recipe loads, `recipes.config.Recipe.validate`.)
"""

from __future__ import annotations

import dataclasses

from recipes.config import DeepSpeedSection, MegatronSection

# what to use instead, per refused key (the rest: the section's own engine)
_INSTEAD = {
    "deepspeed.zero_stage": "megatron.distributed_optimizer shards the optimizer state over data-parallel ranks",
    "deepspeed.offload_optimizer": "the Megatron engine keeps the optimizer on the GPU; more data-parallel ranks "
                                   "(with megatron.distributed_optimizer) or pipeline stages shrink it",
    "deepspeed.offload_params": "the Megatron engine keeps the weights on the GPU; megatron.tp_size / pp_size "
                                "split them",
    "deepspeed.reduce_dtype": "the Megatron engine reduces gradients in fp32",
    "megatron.recompute": "model.gradient_checkpointing",
    "megatron.tp_size": "deepspeed.tp_size (AutoTP)",
}


def _changed(section, defaults) -> list[tuple[str, object]]:
    return [(f.name, getattr(section, f.name)) for f in dataclasses.fields(defaults)
            if getattr(section, f.name) != getattr(defaults, f.name)]


def engine_setting_problems(recipe) -> tuple[list[str], list[str]]:
    """(errors, notes) for settings `recipe.train.engine` does not read (module docstring). Applies the
    mapping in place (`model.gradient_checkpointing` -> `megatron.recompute`), so call it once, before
    anything reads the recipe's layout (the memory plan, the engine)."""
    errors: list[str] = []
    notes: list[str] = []
    m = recipe.model
    if recipe.train.engine == "megatron":
        if m.gradient_checkpointing:  # mapped, then off: the recipe (and its dump) says what runs
            m.gradient_checkpointing = False
            if recipe.megatron.recompute is None:
                recipe.megatron.recompute = "full"
                notes.append("model.gradient_checkpointing: true is the DeepSpeed engine's switch; on Megatron it "
                             "sets megatron.recompute: full (every layer's forward recomputed in backward)")
            else:
                notes.append(f"model.gradient_checkpointing: true is the DeepSpeed engine's switch; Megatron uses "
                             f"megatron.recompute: {recipe.megatron.recompute} as set")
        if m.attn_implementation is not None:
            errors.append(f"model.attn_implementation: {m.attn_implementation!r} is a Hugging Face attention kernel; "
                          "the Megatron engine runs Megatron-core's own attention: remove the setting")
        other, section, defaults = "deepspeed", recipe.deepspeed, DeepSpeedSection()
    else:
        other, section, defaults = "megatron", recipe.megatron, MegatronSection()
    for name, value in _changed(section, defaults):
        key = f"{other}.{name}"
        if key == "deepspeed.tp_size":  # refused when the recipe loads (recipes.config)
            continue
        instead = _INSTEAD.get(key, f"train.engine: {other}")
        errors.append(f"{key}: {value!r} is read by the {other} engine only; this recipe trains on "
                      f"train.engine: {recipe.train.engine}, which would ignore it (remove it; instead: {instead})")
    return errors, notes
