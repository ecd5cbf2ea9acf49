"""Settings one engine reads and the recipe's engine would ignore: adopted onto the engine's own settings
and said, or refused naming the key (docs/reliability.md, "Settings the engine ignores").

A recipe switched from `train.engine: deepspeed` to `megatron` (or back) keeps sections and keys the new
engine never reads; a run that silently drops a setting trains something other than what the recipe says
(activation recomputation lost: an 80 GB GPU runs out of memory at step 1, or an offloaded optimizer
comes back onto the GPU). Each engine states what its own settings ask for in neutral terms
(`EngineContract.stated_intents`); the recipe's engine adopts each one it has an equivalent for
(`adopt_settings`: ZeRO sharding -> the distributed optimizer, gradient checkpointing <-> full
recomputation, AutoTP's tp_size <-> megatron.tp_size, the chunked head -> vocab-parallel logits, ...),
writes it into the recipe (the run's `recipe.yaml` then says what runs: the other engine's key is reset to
its default) with one note for the log, and refuses each intent that would be lost (an offload, raw
`deepspeed.overrides`, pipeline or expert parallelism on DeepSpeed, ...): exit 2, naming the key.
"""

from __future__ import annotations

from recipes.engines import engine_contract


def engine_setting_problems(recipe) -> tuple[list[str], list[str]]:
    """(errors, notes) for the settings `recipe.train.engine` does not read (module docstring). Writes
    the adopted settings into the recipe, so call it once, before anything reads the recipe's layout
    (the memory plan, the engine)."""
    return engine_contract(recipe).adopt_settings(recipe)
