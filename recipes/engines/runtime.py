"""Building the engine a recipe names, for this rank: the one place the engines' runtime modules (which
import torch and deepspeed or megatron) are reached from outside their packages, each imported only when
its engine is asked for. A contract names its runtime objects as "module:name" strings (it stays pure)."""

from __future__ import annotations

import importlib

from . import engine_contract


def runtime_object(path: str):
    """The object a contract names as "package.module:name" (its module imported now)."""
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def engine_class(recipe):
    """The `recipes.training.engine.Engine` class of the recipe's `train.engine` (its `runtime_class`)."""
    return runtime_object(engine_contract(recipe).runtime_class)


def build_engine(recipe, runtime, dirs):
    """The engine `train.engine` names, built for this rank (a collective: every rank calls it)."""
    return engine_class(recipe)(recipe, runtime, dirs)
