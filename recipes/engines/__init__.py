"""The training engines and the one contract through which the rest of the project asks them.

`ENGINES` maps each `train.engine` value to its contract (`recipes.engines.contract.EngineContract`):
deepspeed (Hugging Face models under DeepSpeed ZeRO and AutoTP) and megatron (Megatron-core GPTModel:
TP, PP, SP, EP, the distributed optimizer). `engine_contract(recipe_or_name)` looks one up.

Each engine's folder holds all of that engine, in two sub-folders whose names are their floors
(docs/architecture.md):
- `pure/`: its contract (section, rules, the names of its runtime objects), plan, cost model, report lines
  and the other rules that need no torch. They may import numloss, data_prep, recipes.planning and
  recipes.parallel_dims, never recipes.config (the recipe is passed in).
- `runtime/`: the engine, model, step, checkpoints, export, ..., which import torch and the engine's
  library and may import everything up to recipes.reliability; `recipes.engines.runtime.build_engine`
  builds one. This package's own import stays light: it imports the contracts only.
"""

from __future__ import annotations

from .contract import EngineContract
from .deepspeed.pure.contract import DeepSpeedContract
from .megatron.pure.contract import MegatronContract

ENGINES: dict[str, EngineContract] = {}


def register(contract_class: type[EngineContract]) -> EngineContract:
    """Add an engine to `ENGINES`, the one registry: the shipped engines below; another package's engine by
    one call at its import, before a recipe naming it loads. A name already registered is refused."""
    contract = contract_class(ENGINES)
    if contract.name in ENGINES:
        raise ValueError(f"engine {contract.name!r} is registered already")
    ENGINES[contract.name] = contract
    return contract


for _contract in (DeepSpeedContract, MegatronContract):
    register(_contract)


def engine_contract(recipe_or_name) -> EngineContract:
    """The contract of `train.engine` (a recipe, or the engine's name). Unknown: ValueError naming the
    key and the known engines."""
    name = recipe_or_name if isinstance(recipe_or_name, str) else recipe_or_name.train.engine
    try:
        return ENGINES[name]
    except (KeyError, TypeError):
        raise ValueError(f"train.engine: {name!r} is not one of {list(ENGINES)}") from None
