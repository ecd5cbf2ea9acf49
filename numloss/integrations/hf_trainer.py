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

What the subclass changes, through the Trainer's documented overrides only (`Trainer.compute_loss` with
`loss_is_scaled_for_ga`, `get_batch_samples`, `evaluation_loop`, `log`; no `compute_loss_func`, which
TRL deprecates and removes in 2.0):
- `get_batch_samples`: the Trainer reads each optimizer step's micro-batches ahead with it. After its
  own reading, the step's loss counts (valid tokens, numeric positions, sequences, ...) are taken from
  the micro-batches' labels alone and summed over the processes in one SUM all-reduce
  (`numloss.normalization.reduce_counts`); they replace the Trainer's token count as the step's
  `num_items_in_batch`. At the first step the Trainer's layout is checked against the process group
  (`trainer_layout.check_first_step`).
- `compute_loss`, training: one forward of the model without labels, in which only its backbone runs and
  the objective is computed from the hidden states (`trainer_head`: the LM head's logits exist one
  vocabulary chunk at a time, from the batch's first labelled position on, with the model's logit scale
  and soft cap; no full-vocabulary logits, as under TRL's fused head), with those counts (each
  micro-batch's share of the global batch's loss) times the number of processes (which undoes DDP's, or
  DeepSpeed's, mean over ranks); `loss_is_scaled_for_ga = True` tells the Trainer not to divide it by the
  accumulation steps. The labels it sees are the batch's: TRL's completion-only / assistant-only labels
  under SFTTrainer. Under SFTTrainer the same hidden states also give TRL's metrics (entropy,
  mean_token_accuracy, num_tokens), so a micro-batch costs one forward, as in SFTTrainer. A model whose
  head is not a plain bias-free Linear (`trainer_head.head_problem`) is trained from its logits instead
  (`logits_to_keep` from the first labelled position). Evaluation runs the model's own forward and its
  logits (a `compute_metrics` needs them).
- the first training micro-batch: each term's value against CE on it (over its own counts), and a term
  more than 5x CE at its weight named with the weight that would match (`numloss.scale_check`; a warning
  on the main process, before the first optimizer step; nothing refused).
- `evaluation_loop`: `eval_loss` (and `eval_ce`, `eval_term/<name>`, ...) is the objective of the
  whole evaluation set (`trainer_loss.EvalSums`), the same at any evaluation batch size.
- `log`: adds `ce`, `term/<name>` and `numeric_positions` of the global batch, averaged over the steps
  since the last log as the Trainer averages its `loss` (and TRL's metrics under SFTTrainer).

Parallel contract: every process is one data-parallel rank (DDP, or DeepSpeed ZeRO through the
Trainer) holding full logits or hidden states (under ZeRO-3 the LM head's weight is gathered for the
model's forward and backward: `trainer_head.register_zero3_head`); the counts' all-reduce runs once per optimizer step on every rank, the
logged sums' once per log, the layout check's all-gather once, at the first step, and evaluation adds
one all-gather per evaluated batch. Tensor, context and sequence parallelism (ranks that share a
batch; accelerate's `parallelism_config` with tp, cp or sp > 1, refused before the Trainer is made, naming
`recipes.train` with `deepspeed.sp_size` or `numloss.Objective(..., sequence_split=)` for long rows) are
refused, as is torch's single-process `DataParallel` (`n_gpu > 1`).

Not covered: NTIL averages over sequences, and under TRL's packing a packed row counts as one sequence
(the loss function sees labels, not where packed examples start); every other term is exact there.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from ..labels import shift_labels
from ..logit_stats import IGNORE_INDEX
from ..normalization import LossCounts, reduce_counts
from ..objective import Objective, ObjectiveConfig
from ..scale_check import scale_lines
from ..vocab import NumericVocab
from .trainer_layout import check_construction, check_first_step, check_parallelism_config
from .trainer_head import first_labelled, head_problem, install, objective_head, register_zero3_head
from .trainer_loss import EvalSums, StepLoss, input_tokens, token_metric_sums

logger = logging.getLogger(__name__)

# The versions the tests ran, and the oldest transformers whose Trainer reads `loss_is_scaled_for_ga`.
TESTED = {"transformers": "5.25.0", "trl": "1.16.0"}
MIN_TRANSFORMERS = (5, 19)
INSTALL = "pip install -e '.[hf]' in a clone of numloss"  # transformers' Trainer, TRL's SFTTrainer, PEFT


def check_transformers() -> None:
    """Refuse a transformers without the Trainer behaviour this module relies on: `compute_loss`'s loss
    used as is when `loss_is_scaled_for_ga` is True (5.19 on), and multiplied by nothing else."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("transformers")
    except PackageNotFoundError as err:
        raise ImportError(f"numloss.integrations.hf_trainer needs transformers: {INSTALL}") from err
    major_minor = tuple(int(part) for part in found.split(".")[:2])
    if not (MIN_TRANSFORMERS <= major_minor < (MIN_TRANSFORMERS[0] + 1, 0)):
        raise RuntimeError(f"numloss.integrations.hf_trainer needs transformers {MIN_TRANSFORMERS[0]}.x from"
                           f" {MIN_TRANSFORMERS[0]}.{MIN_TRANSFORMERS[1]} (tested with {TESTED['transformers']});"
                           f" found {found}: how the Trainer scales compute_loss's loss may differ")


def takes_logits_to_keep(model) -> bool:
    """Whether the Hugging Face model under any PEFT wrapper takes `logits_to_keep` (transformers' causal LMs
    do: the LM head then runs on the last positions only)."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        return "logits_to_keep" in inspect.signature(base.forward).parameters
    except (TypeError, ValueError):  # a forward without a readable signature
        return False


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

    # the loss compute_loss returns is already the step's share (transformers >= 5.19 reads this)
    loss_is_scaled_for_ga = True
    # TRL's SFTTrainer: its forward inputs, its metrics from our logits (set by numeric_trainer_class)
    numeric_sft = False

    def __init__(self, *args, numeric_vocab: NumericVocab, objective: ObjectiveConfig | dict | None = None,
                 **kwargs):
        check_transformers()
        if kwargs.get("compute_loss_func") is not None:
            raise ValueError("numloss: the trainer's loss is the numeric objective; do not pass compute_loss_func")
        objective = objective if isinstance(objective, ObjectiveConfig) else ObjectiveConfig.from_dict(objective or {})
        if objective.ignore_index != IGNORE_INDEX:
            raise ValueError(f"numloss: the Trainer's labels ignore {IGNORE_INDEX}; objective.ignore_index is"
                             f" {objective.ignore_index}")
        self.numeric_loss = StepLoss(Objective(numeric_vocab, objective), token_metrics=self.numeric_sft)
        self._numeric_steps = 0  # optimizer steps whose values wait for the next log
        self._numeric_layout_checked = False
        self._numeric_scale_said = False  # the terms' scale against CE, said at the first micro-batch
        self._numeric_eval: EvalSums | None = None  # set while evaluation_loop runs
        check_parallelism_config(kwargs.get("args", args[1] if len(args) > 1 else None))
        super().__init__(*args, **kwargs)
        check_construction(self, sft=self.numeric_sft)
        self._numeric_keeps_logits = takes_logits_to_keep(self.model)
        # training runs the objective from hidden states inside the model's forward, where its head allows
        self._numeric_head_problem = head_problem(self.model)
        if self._numeric_head_problem is None:
            install(self.model)

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device) -> tuple[list, Any]:
        """The Trainer's reading of one optimizer step's micro-batches, with the step's `LossCounts` (over
        every process) in place of its token count. Collective: one SUM all-reduce per step (and the
        layout check's all-gather at the first)."""
        batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        if not self._numeric_layout_checked:
            check_first_step(self, len(batches))
            self._numeric_layout_checked = True
        if not batches:
            return batches, None
        self._numeric_steps += 1
        return batches, step_counts(self.numeric_loss.objective, batches)

    def _numeric_inputs(self, inputs: dict) -> tuple[dict, torch.Tensor]:
        """(the forward's inputs without labels, the labels shifted as HF shifts them)."""
        inputs = dict(inputs)
        labels = inputs.pop("labels", None)
        if labels is None:
            raise ValueError("numloss: the batch has no labels (the numeric objective needs them)")
        if "shift_labels" in inputs:
            raise ValueError("numloss: batches with `shift_labels` are not supported; give `labels` only")
        if self.numeric_sft:
            inputs["use_cache"] = False  # as SFTTrainer: no cache in a loss forward
            if getattr(self, "aux_loss_enabled", False):
                inputs["output_router_logits"] = True  # as SFTTrainer: MoE models return their aux loss
        return inputs, shift_labels(labels, self.numeric_loss.objective.config.ignore_index)

    def _numeric_forward(self, model, inputs: dict, full_logits: bool) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """The logits path (evaluation; training where `head_problem` names a reason): one forward of the
        model itself, without labels: (outputs, logits, the shifted labels aligned with the logits). Unless
        `full_logits` (the caller gets the outputs) and where the model takes `logits_to_keep`, the logits
        start at the first position where a row has a label: the LM head skips the prompt before it. Kept
        whole to the end, so no labelled position and no gap is left out (numeric runs and sequences are as
        in the batch)."""
        inputs, shifted = self._numeric_inputs(inputs)
        if not full_logits and self._numeric_keeps_logits:
            start = first_labelled(shifted, self.numeric_loss.objective.config.ignore_index)
            inputs["logits_to_keep"] = shifted.shape[-1] - start
        outputs = model(**inputs)
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        return outputs, logits, shifted[..., shifted.shape[-1] - logits.shape[-2]:]

    def _numeric_training_loss(self, model, inputs: dict, counts: LossCounts) -> tuple[torch.Tensor, dict]:
        """This micro-batch's share of the step's objective: from the model's hidden states inside its
        forward (`trainer_head`: no full-vocabulary logits), or from its logits where the model's head
        cannot run that way. (loss, outputs: `token_metrics` [3] sums under SFTTrainer, `aux_loss`)."""
        if self._numeric_head_problem is None:
            inputs, shifted = self._numeric_inputs(inputs)
            register_zero3_head(self.accelerator.unwrap_model(model))
            outputs = model(**inputs, numeric_head=objective_head(self.numeric_loss, shifted, counts))
            return outputs["loss"], outputs
        outputs, logits, shifted = self._numeric_forward(model, inputs, full_logits=False)
        loss = self.numeric_loss.micro_batch(logits, shifted, counts).loss
        metrics = token_metric_sums(logits, shifted, self.numeric_loss.objective.config.ignore_index).sum(0) \
            if self.numeric_sft else None
        aux = outputs.get("aux_loss") if isinstance(outputs, dict) else None
        return loss, {"token_metrics": metrics, "aux_loss": aux}

    def compute_loss(self, model, inputs: dict, return_outputs: bool = False, num_items_in_batch=None):
        """Training (`model.training`): this micro-batch's share of the step's objective, over the step's
        `LossCounts` from `get_batch_samples`, times the number of processes. Evaluation: the batch's
        own objective (inside `evaluation_loop`, its rows are also kept for the whole set's)."""
        if not model.training or return_outputs:
            outputs, logits, shifted = self._numeric_forward(model, inputs, full_logits=return_outputs)
            if model.training:  # a caller that wants the outputs of a training step
                return self.numeric_loss.micro_batch(logits, shifted, num_items_in_batch).loss, outputs
            evaluated = EvalSums(self.numeric_loss.objective, token_metrics=self.numeric_sft) \
                if self._numeric_eval is None else self._numeric_eval
            rows = evaluated.rows(logits, shifted)
            if self._numeric_eval is not None:
                self._numeric_eval.add(self.accelerator.gather_for_metrics(rows))
            loss = torch.tensor(evaluated.result(rows.sum(0))["loss"], dtype=torch.float32, device=logits.device)
            return (loss, outputs) if return_outputs else loss
        if not isinstance(num_items_in_batch, LossCounts):
            raise RuntimeError("numloss: a training micro-batch came without the step's LossCounts: the trainer"
                               " did not read its batches through get_batch_samples (a trainer change not"
                               f" covered by this integration; tested with {TESTED})")
        loss, outputs = self._numeric_training_loss(model, inputs, num_items_in_batch)
        if not self._numeric_scale_said:
            self._numeric_scale_said = True
            self._say_scale(inputs, num_items_in_batch)
        loss = loss * self.accelerator.num_processes  # undo the mean over data-parallel ranks
        if self.numeric_sft:
            self.numeric_loss.add_token_metrics(outputs["token_metrics"], input_tokens(inputs))
            aux = outputs.get("aux_loss")
            if aux is not None and getattr(self, "aux_loss_enabled", False):
                # SFTTrainer's MoE load-balancing loss: a per-micro-batch mean, averaged over the step
                loss = loss + self.router_aux_loss_coef * aux / self.current_gradient_accumulation_steps
        return loss

    def _say_scale(self, inputs: dict, step_counts: LossCounts) -> None:
        """Before the first optimizer step: each term against CE on this process's first micro-batch
        (`numloss.scale_check`); a term many times CE at its weight is named, with the weight that would
        match (a warning on the main process; nothing is refused)."""
        if not self.accelerator.is_main_process:
            return
        objective = self.numeric_loss.objective
        own = objective.counts(shift_labels(inputs["labels"], objective.config.ignore_index))
        ce, terms = self.numeric_loss.own_values(step_counts, own)
        for line in scale_lines(objective.config, ce, terms):
            logger.warning("numloss: %s", line)

    def evaluation_loop(self, dataloader, description: str, prediction_loss_only: bool | None = None,
                        ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"):
        """The Trainer's loop, with `<prefix>_loss` replaced by the objective of the whole evaluated set
        and `<prefix>_ce`, `<prefix>_term/<name>`, `<prefix>_numeric_positions` (and TRL's entropy and
        mean_token_accuracy under SFTTrainer) added, all over every process's rows."""
        self._numeric_eval = EvalSums(self.numeric_loss.objective, token_metrics=self.numeric_sft)
        try:
            output = super().evaluation_loop(dataloader, description, prediction_loss_only=prediction_loss_only,
                                             ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
            evaluated = self._numeric_eval.result()
        finally:
            self._numeric_eval = None
        output.metrics.update({f"{metric_key_prefix}_{key}": value for key, value in evaluated.items()})
        return output

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's log, with the numeric objective's values added to its training logs."""
        if "loss" in logs and self._numeric_steps:
            logs.update(self.numeric_loss.take_logged(self._numeric_steps))
            self._numeric_steps = 0
        super().log(logs, start_time)


def _is_sft_trainer(base: type) -> bool:
    return any(klass.__name__ == "SFTTrainer" and klass.__module__.startswith("trl.") for klass in base.__mro__)


@functools.cache
def numeric_trainer_class(base: type) -> type:
    """`base` (`transformers.Trainer` or a subclass: TRL's `SFTTrainer`, a tool's own) with the numeric
    objective: `class Numeric<Base>(NumericTrainerMixin, base)`."""
    if not any(klass.__name__ == "Trainer" and klass.__module__.startswith("transformers")
               for klass in base.__mro__):
        raise TypeError(f"{base.__name__} is not a transformers.Trainer subclass")
    return type(f"Numeric{base.__name__}", (NumericTrainerMixin, base),
                {"__doc__": f"{base.__name__} trained with the numloss objective (numloss.integrations.hf_trainer).",
                 "numeric_sft": _is_sft_trainer(base)})


def __getattr__(name: str):
    """`NumericTrainer` and `NumericSFTTrainer`, made (and their framework imported) on first use."""
    if name not in ("NumericTrainer", "NumericSFTTrainer"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    what = "TRL's SFTTrainer" if name == "NumericSFTTrainer" else "transformers' Trainer"
    try:
        if name == "NumericTrainer":
            from transformers import Trainer as base
        else:
            from trl import SFTTrainer as base
    except ImportError as err:
        raise ImportError(f"numloss.integrations.hf_trainer.{name} needs {what}, which is not installed"
                          f" ({err}): {INSTALL}") from err
    return numeric_trainer_class(base)
