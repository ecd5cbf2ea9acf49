"""The learning-rate schedule every engine steps with: a factor of the peak `optim.lr` per step.

The schedule is a function of the step and the recipe alone (`optim.lr`, `warmup_steps`, `schedule`,
`min_lr_ratio`, `train.steps`): optimizer step n (1-based) runs at `optim.lr * factor(n - 1)`. A resumed
run re-evaluates it for its own recipe at the step its checkpoint reached (`apply_recipe_schedule`), as
Megatron-LM's `--override-opt-param-scheduler` does: a lower `optim.lr`, another warmup or more
`train.steps` take effect at the first step after the checkpoint, and nothing of the old recipe's
schedule survives in the optimizer (`recipes.reliability.resume_policy` logs the change).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from recipes.config import Recipe


@dataclass(frozen=True)
class Schedule:
    """Linear warmup to the peak, then cosine down to `min_lr_ratio` of it (or constant)."""

    lr: float
    warmup_steps: int
    total_steps: int
    schedule: str  # cosine | constant
    min_lr_ratio: float

    @classmethod
    def of(cls, recipe: Recipe) -> "Schedule":
        o = recipe.optim
        return cls(o.lr, o.warmup_steps, recipe.train.steps, o.schedule, o.min_lr_ratio)

    @classmethod
    def of_dict(cls, recipe: dict) -> "Schedule":
        """The schedule of a recipe as `Recipe.to_dict()` wrote it (a checkpoint's `recipe.json`), with
        the recipe's defaults where a key is missing."""
        o, defaults = recipe.get("optim", {}), Recipe().optim
        return cls(float(o.get("lr", defaults.lr)), int(o.get("warmup_steps", defaults.warmup_steps)),
                   int(recipe.get("train", {}).get("steps", Recipe().train.steps)),
                   str(o.get("schedule", defaults.schedule)), float(o.get("min_lr_ratio", defaults.min_lr_ratio)))

    def factor(self, step: int) -> float:
        """The factor of the peak after `step` optimizer steps (LambdaLR's `last_epoch`)."""
        warmup, total, floor = self.warmup_steps, self.total_steps, self.min_lr_ratio
        if warmup and step < warmup:
            return (step + 1) / warmup
        if self.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    def lr_of_step(self, step: int) -> float:
        """The learning rate optimizer step `step` (1-based, as logged) runs at; LambdaLR's expression."""
        return self.lr * self.factor(step - 1)


def lr_lambda(recipe: Recipe):
    """The recipe's schedule as a LambdaLR factor of the step count (a plain function: LambdaLR's
    state_dict then stores nothing of it, and the recipe decides the schedule at every start)."""
    schedule = Schedule.of(recipe)

    def factor(step: int) -> float:
        return schedule.factor(step)

    return factor


def apply_recipe_schedule(scheduler, recipe: Recipe) -> None:
    """After a checkpoint is loaded into `scheduler` (a LambdaLR) and its optimizer: the optimizer's
    hyperparameters and the learning rate become the recipe's, at the step count the checkpoint reached.

    Why: loading restores the saved param groups (lr, betas, eps, weight_decay) and the scheduler's
    saved `base_lrs`, so a recipe that lowered `optim.lr` on resume kept training at the old one while
    `recipe.yaml` showed the new one. The optimizer's state (moments, step counts) stays the
    checkpoint's. With an unchanged recipe this writes the values the checkpoint held, bit for bit
    (the same expression as LambdaLR's `get_lr`), so a resume stays bit-exact."""
    o, factor = recipe.optim, lr_lambda(recipe)
    groups = scheduler.optimizer.param_groups
    scheduler.base_lrs = [o.lr] * len(groups)
    scheduler.lr_lambdas = [factor] * len(groups)
    for group in groups:
        group.update(initial_lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
        group["lr"] = o.lr * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in groups]  # what get_last_lr() reports
