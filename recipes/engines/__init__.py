"""Training engines behind `recipes.train`: deepspeed/ (Hugging Face models under DeepSpeed ZeRO and
AutoTP) and megatron/ (Megatron-core GPTModel: TP, PP, SP, distributed optimizer). Each may import
numloss, data_prep, recipes.config and recipes.training; never recipes.train, planning or evaluation."""

from __future__ import annotations


def build_engine(recipe, runtime, dirs):
    """The engine `train.engine` names, built for this rank (a collective: every rank calls it)."""
    if recipe.train.engine == "megatron":
        from .megatron.engine import MegatronEngine

        return MegatronEngine(recipe, runtime, dirs)
    from .deepspeed.engine import DeepSpeedEngine

    return DeepSpeedEngine(recipe, runtime, dirs)
