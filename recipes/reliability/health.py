"""Whether training is still sane, decided the same on every rank: non-finite values stop the run,
non-finite weights are never saved or exported, a gradient norm stuck at exactly 0 is a warning.

Policy (no skipping): a step whose global loss, a logged term or the gradient norm is NaN or inf has
already been applied by the engine's optimizer, so the weights after it cannot be trusted. The run logs
that step's row (non-finite values as null, `"nonfinite": [keys]`), writes no checkpoint and no export,
and stops with `NonFiniteTraining` (`python -m recipes.train` exits 3); the last checkpoint, saved
from a step whose values were all finite, stays `latest`. Before every checkpoint and the export the
engine's own parameters are checked as well (`Engine.weights_finite`, each rank its own shards, then
one all-reduce): an update can make the weights infinite while the loss of that step was still finite
(`optim.lr: 1e39`), and the next step would only see NaN after a save.

The ranks agree through `any_rank`, one MAX all-reduce over the world per step (it also carries the
preemption request, `recipes.reliability.preemption`), so every rank stops at the same step and no rank is
left waiting in a collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

ZERO_GRAD_STEPS = 3  # this many steps in a row with a gradient norm of exactly 0: a warning


class NonFiniteTraining(RuntimeError):
    """Training produced NaN or inf; nothing was saved after the last good checkpoint. The message's advice
    follows what can have caused it (`nonfinite_hint`)."""

    def __init__(self, step: int, keys: list[str], last_checkpoint: str | None, before_any_update: bool = False):
        self.step, self.keys, self.last_checkpoint = step, keys, last_checkpoint
        kept = f"the last checkpoint is {last_checkpoint} (finite)" if last_checkpoint else "no checkpoint was written"
        super().__init__(f"step {step}: {', '.join(keys)} not finite; stopped without saving or exporting "
                         f"({kept}). {nonfinite_hint(keys, before_any_update)}")


def nonfinite_hint(keys: list[str], before_any_update: bool) -> str:
    """What can help, given which values were not finite and whether this run had updated the weights yet.
    A lower learning rate only helps values that the updates made non-finite."""
    terms = [k[len("term/"):] for k in keys if k.startswith("term/")]
    if terms and "ce" not in keys:  # the numeric term alone: its math on the vocabulary's values
        return (f"Cross-entropy is finite, so the numeric term{'s' * (len(terms) > 1)} {', '.join(terms)} overflowed "
                f"on the numeric vocabulary's values, whatever the learning rate: lower loss.numeric_max_value or use "
                f"a bounded term (ntl_was, smmd, dist2) for numbers this large, or check the term's options")
    if before_any_update:
        return ("This run had applied no update yet, so the learning rate is not the cause: the weights it started "
                "from (the model, or the checkpoint it resumed) or the step's inputs are; check the data "
                "(python -m data_prep inspect) and the model's weights")
    return ("Lower optim.lr (or raise optim.warmup_steps), check the data, and resume from the last checkpoint")


def any_rank(flags: list[bool], device: torch.device) -> list[bool]:
    """Each flag OR-ed over every rank of the world (one MAX all-reduce); as given in a world of one."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [bool(f) for f in flags]
    t = torch.tensor([1.0 if f else 0.0 for f in flags], dtype=torch.float32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v > 0) for v in t.tolist()]


def weights_finite(engine, device: torch.device) -> bool:
    """Every rank's parameters are finite (`engine.weights_finite()`, where the engine has it). A collective."""
    check = getattr(engine, "weights_finite", None)
    local = True if check is None else bool(check())
    return not any_rank([not local], device)[0]


class ZeroGradWatch:
    """Warns once when the gradient norm is exactly 0 for `ZERO_GRAD_STEPS` steps in a row: a collapsed
    model (every logit saturated: `optim.lr: 1e6` gave CE stuck at ln V) or nothing that trains."""

    def __init__(self, steps: int = ZERO_GRAD_STEPS):
        self.steps, self.run, self.warned = steps, 0, False

    def update(self, step: int, grad_norm: float | None) -> str | None:
        self.run = self.run + 1 if grad_norm == 0.0 else 0
        if self.run >= self.steps and not self.warned:
            self.warned = True
            return (f"warning: the gradient norm has been exactly 0 for {self.run} steps (steps "
                    f"{step - self.run + 1}-{step}): the model has collapsed or nothing trains "
                    f"(an optim.lr far too high does this); the run goes on")
        return None
