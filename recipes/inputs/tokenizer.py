"""The recipe's tokenizer (or, for vision recipes, its processor), as every engine and evaluation load it."""

from __future__ import annotations

from recipes.config import Recipe

from .vision import load_processor


def load_tokenizer(recipe: Recipe):
    """(tokenizer, processor): the processor (vision recipes only, else None) carries the tokenizer."""
    from transformers import AutoTokenizer

    source = recipe.model.tokenizer or recipe.model.name_or_path
    if recipe.model.vision:
        processor = load_processor(source, trust_remote_code=recipe.model.trust_remote_code)
        return processor.tokenizer, processor
    return AutoTokenizer.from_pretrained(source, trust_remote_code=recipe.model.trust_remote_code), None
