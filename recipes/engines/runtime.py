"""Building the engine a recipe names, for this rank: the one place the engines' runtime modules (which
import torch and deepspeed or megatron) are reached from outside their packages, each imported only when
its engine is asked for."""

from __future__ import annotations

from . import engine_contract


def _deepspeed():
    from .deepspeed.engine import DeepSpeedEngine

    return DeepSpeedEngine


def _megatron():
    from .megatron.engine import MegatronEngine

    return MegatronEngine


# train.engine -> its `recipes.training.engine.Engine` class
ENGINE_CLASSES = {"deepspeed": _deepspeed, "megatron": _megatron}


def engine_class(recipe):
    """The `Engine` class of the recipe's `train.engine` (its runtime module imported now)."""
    return ENGINE_CLASSES[engine_contract(recipe).name]()


def build_engine(recipe, runtime, dirs):
    """The engine `train.engine` names, built for this rank (a collective: every rank calls it)."""
    return engine_class(recipe)(recipe, runtime, dirs)
