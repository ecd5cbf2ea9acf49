"""numloss in the Hugging Face `Trainer` and TRL's `SFTTrainer`: the numeric objective with every term
divided by the optimizer step's global counts, each term logged through the Trainer's own logging.

    from numloss import NumericVocab
    from numloss.integrations.hf_trainer import NumericTrainer     # NumericSFTTrainer: TRL's SFTTrainer

    vocab = NumericVocab.from_tokenizer(tokenizer, policy="digits")
    trainer = NumericTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator,
                             numeric_vocab=vocab, objective={"terms": {"smmd": {}}})
    trainer.train()       # logs loss, ce, term/smmd, numeric_positions (TensorBoard, W&B: train/term/smmd)

`NumericTrainer` and `NumericSFTTrainer` are made on first use (this module imports neither
transformers nor TRL before that); `numeric_trainer_class(base)` makes the same subclass of any other
Trainer subclass (the trainers of tools built on the Trainer). Everything else (arguments, datasets,
collators, PEFT models, callbacks, checkpoints) is the base trainer's own.

What the subclass changes, through the Trainer's public API only:
- `get_batch_samples`: the Trainer reads each optimizer step's micro-batches ahead with it. After its
  own reading, the step's loss counts (valid tokens, numeric positions, sequences, ...) are taken from
  the micro-batches' labels alone and summed over the processes in one SUM all-reduce
  (`numloss.normalization.reduce_counts`); they replace the Trainer's token count as the step's
  `num_items_in_batch`.
- `compute_loss_func` (a Trainer argument, so this is the loss both trainers compute with, and TRL's
  completion-only / assistant-only labels are the labels it sees): the objective on `outputs.logits`
  with those counts, so each micro-batch's loss is its share of the global batch's loss.
- `log`: adds `ce`, `term/<name>` and `numeric_positions` of the global batch, averaged over the steps
  since the last log as the Trainer averages its `loss`.

Scaling, read from transformers 5.24's and TRL 1.16's source and checked by the tests: a loss from a
`compute_loss_func` counts as normalised over the accumulated batch (the Trainer does not divide it by
the accumulation steps), and with `average_tokens_across_devices` (the default) the Trainer multiplies
it by the number of processes, which undoes DDP's (or DeepSpeed's) mean over the ranks. The update is
then the gradient of the global batch's loss, and the Trainer's logged `loss` is that loss.

Parallel contract: every process is one data-parallel rank (DDP, or DeepSpeed ZeRO through the
Trainer) holding full logits; the counts' all-reduce runs once per optimizer step on every rank, the
logged sums' once per log. Tensor, context and sequence parallelism (ranks that share a batch) are
refused, as is torch's single-process `DataParallel` (`n_gpu > 1`).

Not covered: NTIL averages over sequences, and under TRL's packing a packed row counts as one sequence
(the loss function sees labels, not where packed examples start); every other term is exact there.
SFTTrainer with a `compute_loss_func` runs one more forward without gradients for its own metrics
(entropy, token accuracy): TRL's choice, not this module's.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from ..adapters.deepspeed_autotp import causal_lm_objective, shift_labels
from ..logit_stats import IGNORE_INDEX
from ..normalization import LossCounts, reduce_counts
from ..objective import Objective, ObjectiveConfig
from ..vocab import NumericVocab

# The versions whose Trainer behaviour (above) this module relies on, and the major versions accepted.
TESTED = {"transformers": "5.24.0", "trl": "1.16.0"}
SUPPORTED_MAJOR = {"transformers": 5, "trl": 1}


def check_version(package: str) -> None:
    """Refuse a major version of `package` other than the tested one: the scaling above is the Trainer's
    behaviour, not a documented contract, and changed between transformers 4.4x and 5."""
    from importlib.metadata import version

    found = version(package)
    if int(found.split(".")[0]) != SUPPORTED_MAJOR[package]:
        raise RuntimeError(f"numloss.integrations.hf_trainer is tested with {package}=={TESTED[package]} and"
                           f" accepts {package} {SUPPORTED_MAJOR[package]}.x; found {found}: how the trainer"
                           " scales a compute_loss_func's loss over accumulation and processes may differ")


class NumericTrainerLoss:
    """The trainer's `compute_loss_func`: `(outputs, labels, num_items_in_batch=None) -> loss`.

    - `num_items_in_batch` a `LossCounts` (training: the step's, from `get_batch_samples`): the
      objective divided by them, this micro-batch's share of the step's loss; its values are added to
      the sums `take_logged` returns.
    - a number (evaluation: the Trainer's token count of the evaluated batch over the processes): the
      objective on the batch's own counts, weighted by its share of those tokens, so the processes'
      losses combine as the Trainer's own CE does; None: the batch's own objective.
    """

    def __init__(self, objective: Objective):
        self.objective = objective
        self.keys = ["ce", *(f"term/{name}" for name in objective.config.terms), "numeric_positions"]
        self._sums: torch.Tensor | None = None

    def __call__(self, outputs, labels: torch.Tensor | None, num_items_in_batch=None, **_) -> torch.Tensor:
        if labels is None:
            raise ValueError("numloss: the batch has no labels (the numeric objective needs them)")
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        counts = num_items_in_batch if isinstance(num_items_in_batch, LossCounts) else None
        if counts is None and torch.is_grad_enabled() and logits.requires_grad:
            raise RuntimeError("numloss: a training micro-batch came without the step's LossCounts: the trainer"
                               " did not read its batches through get_batch_samples (a trainer change not"
                               f" covered by this integration; tested with {TESTED})")
        out = causal_lm_objective(self.objective, logits, labels.to(logits.device), counts=counts)
        if counts is not None:
            values = torch.stack([out.ce.detach(), *(v.detach() for v in out.terms.values())]).double()
            values = torch.cat([values, values.new_tensor([out.numeric_positions])])
            self._sums = values if self._sums is None else self._sums + values
            return out.loss
        if num_items_in_batch is None:
            return out.loss
        valid = (shift_labels(labels, self.objective.config.ignore_index) != self.objective.config.ignore_index).sum()
        total = torch.as_tensor(num_items_in_batch, device=out.loss.device, dtype=out.loss.dtype).clamp_min(1)
        return out.loss * valid.to(out.loss.dtype) / total

    def take_logged(self, steps: int) -> dict[str, float]:
        """The global batch's `ce`, `term/*`, `numeric_positions` summed over the steps since the last
        call, summed over the processes (one SUM all-reduce: every rank calls it at the same log) and
        divided by `steps`; then the sums start again."""
        if self._sums is None or steps == 0:
            return {}
        sums, self._sums = self._sums, None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        return {key: value / steps for key, value in zip(self.keys, sums.tolist())}


def step_counts(objective: Objective, batches: list[dict], group=None) -> LossCounts:
    """The loss denominators of one optimizer step: every micro-batch of this process counted from its
    (unshifted) labels, summed over `group` (None: every process). Collective: every rank calls it
    once per step."""
    counts = []
    for batch in batches:
        if "shift_labels" in batch:
            raise ValueError("numloss: batches with `shift_labels` (context parallelism, some padding-free"
                             " collators) are not supported; give `labels` only")
        if batch.get("labels") is None:
            raise ValueError("numloss: a training batch has no `labels`")
        counts.append(objective.counts(shift_labels(batch["labels"], objective.config.ignore_index)))
    return reduce_counts(counts, group=group)


class NumericTrainerMixin:
    """The numeric objective in a `transformers.Trainer` subclass; see the module docstring.

    `__init__(*args, numeric_vocab, objective=None, **kwargs)`: `numeric_vocab` from
    `NumericVocab.from_tokenizer`, `objective` an `Objective` spec (`{"terms": {"smmd": {}}}`, an
    `ObjectiveConfig`; None: plain CE); every other argument is the base trainer's."""

    def __init__(self, *args, numeric_vocab: NumericVocab, objective: ObjectiveConfig | dict | None = None,
                 **kwargs):
        check_version("transformers")
        if any(klass.__module__.startswith("trl.") for klass in type(self).__mro__):
            check_version("trl")
        if kwargs.get("compute_loss_func") is not None:
            raise ValueError("numloss: the trainer's compute_loss_func is the numeric objective; do not pass one")
        objective = objective if isinstance(objective, ObjectiveConfig) else ObjectiveConfig.from_dict(objective or {})
        if objective.ignore_index != IGNORE_INDEX:
            raise ValueError(f"numloss: the Trainer's labels ignore {IGNORE_INDEX}; objective.ignore_index is"
                             f" {objective.ignore_index}")
        self.numeric_loss = NumericTrainerLoss(Objective(numeric_vocab, objective))
        self._numeric_steps = 0  # optimizer steps whose values wait for the next log
        super().__init__(*args, compute_loss_func=self.numeric_loss, **kwargs)
        self._check_layout()

    def _check_layout(self) -> None:
        args = self.args
        if args.n_gpu > 1:
            raise ValueError("numloss: torch DataParallel (n_gpu > 1 in one process) is not supported; launch"
                             " one process per device (torchrun, accelerate launch)")
        shared = {"tensor": self.get_tp_size(), "context": self.get_cp_size(), "sequence": self.get_sp_size()}
        if any(size > 1 for size in shared.values()):
            raise ValueError(f"numloss: ranks that share a batch ({shared}) are not supported by the Trainer"
                             " integration; use data parallelism (DDP, DeepSpeed ZeRO)")
        if args.world_size > 1 and not args.average_tokens_across_devices:
            raise ValueError("numloss: average_tokens_across_devices must be True with several processes: the"
                             " Trainer then multiplies the loss by the number of processes, which undoes"
                             " DDP's mean over the ranks")
        if args.label_smoothing_factor:
            raise ValueError("numloss: label_smoothing_factor is not applied by the numeric objective; set it to 0")

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device) -> tuple[list, Any]:
        """The Trainer's reading of one optimizer step's micro-batches, with the step's `LossCounts` (over
        every process) in place of its token count. Collective: one SUM all-reduce per step."""
        batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        if not batches:
            return batches, None
        self._numeric_steps += 1
        return batches, step_counts(self.numeric_loss.objective, batches)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's log, with the numeric objective's values added to its training logs."""
        if "loss" in logs and self._numeric_steps:
            logs.update(self.numeric_loss.take_logged(self._numeric_steps))
            self._numeric_steps = 0
        super().log(logs, start_time)


@functools.cache
def numeric_trainer_class(base: type) -> type:
    """`base` (`transformers.Trainer` or a subclass: TRL's `SFTTrainer`, a tool's own) with the numeric
    objective: `class Numeric<Base>(NumericTrainerMixin, base)`."""
    if not any(klass.__name__ == "Trainer" and klass.__module__.startswith("transformers")
               for klass in base.__mro__):
        raise TypeError(f"{base.__name__} is not a transformers.Trainer subclass")
    return type(f"Numeric{base.__name__}", (NumericTrainerMixin, base),
                {"__doc__": f"{base.__name__} trained with the numloss objective (numloss.integrations.hf_trainer)."})


def __getattr__(name: str):
    """`NumericTrainer` and `NumericSFTTrainer`, made (and their framework imported) on first use."""
    if name == "NumericTrainer":
        from transformers import Trainer

        return numeric_trainer_class(Trainer)
    if name == "NumericSFTTrainer":
        check_version("trl")
        from trl import SFTTrainer

        return numeric_trainer_class(SFTTrainer)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
