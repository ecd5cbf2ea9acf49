"""The learning-rate schedule every engine steps with: a factor of the peak `optim.lr` per step."""

from __future__ import annotations

import math

from recipes.config import Recipe


def lr_lambda(recipe: Recipe):
    """Linear warmup to the peak, then cosine down to `min_lr_ratio` of it (or constant)."""
    warmup, total, floor = recipe.optim.warmup_steps, recipe.train.steps, recipe.optim.min_lr_ratio

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if recipe.optim.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
