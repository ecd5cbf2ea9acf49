"""A Hugging Face causal LM trained with the numeric objective, from logits or from hidden states: the
one way numloss computes it for an HF model, in a user's own training loop and in `recipes.train` alike.

`NumericCausalLM(model, objective, chunked=True)` is an `nn.Module` whose forward takes
(input_ids, attention_mask, labels) and returns a `NumericLMOutput`: a dict (so that ZeRO-3's hooks see
the loss tensor and gather parameters before this module's backward) with attribute access:
`out.loss`, `out.ce`, `out.terms`, `out.numeric_positions`, and `out.log_dict()`. It shifts the labels itself
(position t predicts token t+1), so `labels` are the input ids with -100 where no loss is wanted.

- `chunked=False`: `model(...).logits` through `Objective` (the logits path).
- `chunked=True`: only the backbone runs (`model.<base_model_prefix>`); its last hidden states and the
  lm_head weight go to `Objective.from_hidden`, so the model's full-vocabulary logits are never made. The
  model's logit scale and soft cap (Gemma-2/3, Granite, Cohere) are read from its config and applied there.

Tensor parallelism: with a DeepSpeed AutoTP vocab-parallel lm_head the weight is this rank's vocab
shard and the group and range come from `find_vocab_shard`; the same call runs dense otherwise. AutoTP
partitions the module given to `deepspeed.initialize` by its HF config, `tp_plan` and module names, so
under AutoTP give it `numeric_autotp_model(model, objective)`: the HF model itself, whose forward is
NumericCausalLM's (the same `numeric_lm_forward`).

ZeRO-3: the lm_head weight is used outside its own module's forward, so DeepSpeed's module hooks would
not gather it. It is registered as an external parameter of this wrapper
(`deepspeed.zero.register_external_parameter`), which makes ZeRO-3 gather it in this module's forward
and backward, once per step on every rank whatever its token count. Build the wrapper before
`deepspeed.initialize(model=wrapper, ...)`.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..chunked_head import DEFAULT_CHUNK_SIZE
from ..labels import shift_labels
from ..logit_transform import LogitTransform
from ..normalization import LossCounts
from ..objective import Objective, ObjectiveOutput
from ..sequence_split import SequenceSplit
from .deepspeed_autotp import causal_lm_objective, find_vocab_shard


class NumericLMOutput(dict):
    """`ObjectiveOutput`'s fields as a dict, readable as attributes."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    @classmethod
    def of(cls, out: ObjectiveOutput) -> "NumericLMOutput":
        # grad_sums: detached tensors (or None), which ZeRO-3's output hooks pass through untouched
        return cls(loss=out.loss, ce=out.ce, terms=dict(out.terms), numeric_positions=out.numeric_positions,
                   grad_sums=out.grad_sums)

    def log_dict(self) -> dict[str, float]:
        return ObjectiveOutput(self.loss, self.ce, self.terms, self.numeric_positions,
                               self.get("grad_sums")).log_dict()


class NumericCausalLM(nn.Module):
    def __init__(self, model: nn.Module, objective: Objective, chunked: bool = True,
                 chunk_size: int = DEFAULT_CHUNK_SIZE):
        super().__init__()
        self.model = model
        self.objective = objective
        self.chunked = chunked
        self.chunk_size = chunk_size
        head = model.get_output_embeddings()
        if head is None:
            raise ValueError(f"{type(model).__name__} has no output embeddings (lm_head)")
        if chunked and getattr(head, "bias", None) is not None:
            raise ValueError("the chunked head supports an lm_head without bias; use chunked=False")
        if chunked and hasattr(head.weight, "ds_id"):  # a ZeRO-3 partitioned parameter
            import deepspeed

            deepspeed.zero.register_external_parameter(self, head.weight)

    @property
    def loss_function(self):
        """The wrapped model's HF `loss_function` hook. DeepSpeed AutoTP with a vocab-parallel lm_head
        installs its CE there on the module it was given (this wrapper) and refuses a module without
        one; the hook lives on the HF model, which this wrapper never asks for a loss."""
        return self.model.loss_function

    @loss_function.setter
    def loss_function(self, fn) -> None:
        self.model.loss_function = fn

    def counts(self, labels: torch.Tensor | None, sequence_ids: torch.Tensor | None = None, *,
               sequence_split: SequenceSplit | None = None) -> LossCounts:
        """The loss denominators of one batch of `forward`'s arguments (unshifted labels, as given to
        forward; labels alone, no model call). Sum them over a step with
        `numloss.normalization.reduce_counts` and pass the total to forward as `loss_counts`. With
        `sequence_split` (labels None): this rank's share, to be summed over the data-parallel and the
        split's ranks."""
        if sequence_split is not None:
            return split_batch_counts(self.objective, labels, sequence_ids, sequence_split)
        return batch_counts(self.objective, labels, sequence_ids)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None, attention_mask: torch.Tensor | None = None,
                *, loss_counts: LossCounts | None = None, sequence_ids: torch.Tensor | None = None,
                diagnostics: bool | None = None, sequence_split: SequenceSplit | None = None,
                **model_kwargs) -> NumericLMOutput:
        """`loss_counts`: the step's denominators (the output is then this batch's share of the step's
        loss); None: this batch's own. `sequence_ids` ([B, T], packed rows' segment ids): NTIL averages
        over the examples of packed rows. `diagnostics`: the gradient sums of `numloss.diagnostics` in
        `out.grad_sums` (None: the objective's default). `sequence_split` (`numloss.sequence_split`; labels
        None): the rows are split along the sequence over ranks; `input_ids` (and `position_ids`) are this
        rank's positions, the split holds the whole rows' shifted labels."""
        return numeric_lm_forward(self.model, self.model.forward, self.objective, input_ids, labels, attention_mask,
                                  chunked=self.chunked, chunk_size=self.chunk_size, loss_counts=loss_counts,
                                  sequence_ids=sequence_ids, diagnostics=diagnostics, sequence_split=sequence_split,
                                  **model_kwargs)


def batch_counts(objective: Objective, labels: torch.Tensor, sequence_ids: torch.Tensor | None = None) -> LossCounts:
    """`objective.counts` of a causal LM batch given as the model's (unshifted) labels."""
    return objective.counts(shift_labels(labels, objective.config.ignore_index), sequence_ids)


def split_batch_counts(objective: Objective, labels, sequence_ids, split: SequenceSplit) -> LossCounts:
    """This rank's share of a split batch's counts (the split holds the whole rows' shifted labels)."""
    if labels is not None or sequence_ids is not None:
        raise ValueError("with a sequence_split give labels=None and no sequence_ids: the split holds the whole "
                         "rows' shifted labels and sequence ids")
    return objective.counts(split.local(split.labels), sequence_split=split)


def numeric_lm_forward(model: nn.Module, full_forward, objective: Objective, input_ids: torch.Tensor,
                       labels: torch.Tensor, attention_mask: torch.Tensor | None = None, *, chunked: bool,
                       chunk_size: int = DEFAULT_CHUNK_SIZE, loss_counts: LossCounts | None = None,
                       sequence_ids: torch.Tensor | None = None, diagnostics: bool | None = None,
                       sequence_split: SequenceSplit | None = None, **model_kwargs) -> NumericLMOutput:
    """The numeric objective of HF causal LM `model` on one batch: the forward of `NumericCausalLM` and of
    `numeric_autotp_model`'s model.

    Logits path: `full_forward(...)` (the HF model's own forward) gives `[b, s, V_local]` logits.
    Chunked: only the backbone (`model.<base_model_prefix>`) runs, and its last hidden states meet the
    lm_head weight (this rank's vocab shard under AutoTP) one vocabulary chunk at a time."""
    shard = find_vocab_shard(model)
    per_batch = {"counts": loss_counts, "sequence_ids": sequence_ids, "diagnostics": diagnostics}
    if sequence_split is not None:  # labels shifted on the whole rows, before the split
        if labels is not None or sequence_ids is not None:
            raise ValueError("with a sequence_split give labels=None and no sequence_ids: the split holds the whole "
                             "rows' shifted labels and sequence ids")
        targets = sequence_split.local(sequence_split.labels)
        per_batch["sequence_split"] = sequence_split
    else:
        targets = shift_labels(labels, objective.config.ignore_index)
    if not chunked:
        logits = full_forward(input_ids=input_ids, attention_mask=attention_mask, **model_kwargs).logits
        return NumericLMOutput.of(causal_lm_objective(objective, logits, shard=shard, shifted_labels=targets,
                                                      **per_batch))
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, **model_kwargs).last_hidden_state
    weight = model.get_output_embeddings().weight
    return NumericLMOutput.of(objective.from_hidden(
        hidden, weight, targets, group=shard.group, vocab_start=shard.start, chunk_size=chunk_size,
        logit_transform=LogitTransform.from_model_config(getattr(model, "config", None)), **per_batch))


def numeric_autotp_model(model: nn.Module, objective: Objective, chunked: bool = False,
                         chunk_size: int = DEFAULT_CHUNK_SIZE) -> nn.Module:
    """The HF model itself, its class swapped for a subclass whose forward returns the numeric objective
    (`NumericLMOutput`, as NumericCausalLM: the same `numeric_lm_forward`, logits or chunked head) and
    which has NumericCausalLM's `counts`: what DeepSpeed's AutoTP must partition. Call it before
    `deepspeed.initialize(model=...)`; the model's own `loss_function` hook stays as it is (AutoTP
    installs its vocab-parallel CE there, which this forward never calls).

    Why not the NumericCausalLM wrapper: AutoTP reads the module given to `deepspeed.initialize` for
    its `config` (attention and KV head counts), its HF `tp_plan` and its `loss_function` hook, and
    DeepSpeed 0.19.8 recognises the output head by the module name `lm_head`; under the wrapper the
    name is `model.lm_head` and, whenever the vocabulary is a multiple of the KV head count, the head is
    split like attention, by KV heads: with fewer KV heads than TP ranks some ranks get no vocabulary
    at all and DeepSpeed refuses the model (Qwen2.5-7B, 4 KV heads, at TP 8). Here every name, the
    config and the plan are the HF model's own; checkpoint keys have no `model.` prefix."""
    base = type(model)

    class NumericObjectiveModel(base):
        def counts(self, labels, sequence_ids=None):
            return batch_counts(self.__dict__["_numloss_objective"], labels, sequence_ids)

        def forward(self, input_ids=None, labels=None, attention_mask=None, *, loss_counts=None,
                    sequence_ids=None, diagnostics=None, **kwargs):
            full_forward = functools.partial(base.forward, self)
            return numeric_lm_forward(self, full_forward, self.__dict__["_numloss_objective"], input_ids, labels,
                                      attention_mask, chunked=chunked, chunk_size=chunk_size,
                                      loss_counts=loss_counts, sequence_ids=sequence_ids, diagnostics=diagnostics,
                                      **kwargs)

    NumericObjectiveModel.__name__ = NumericObjectiveModel.__qualname__ = f"Numeric{base.__name__}"
    model.__class__ = NumericObjectiveModel
    model.__dict__["_numloss_objective"] = objective  # not a submodule: no state in the checkpoint
    head = model.get_output_embeddings().weight
    if chunked and hasattr(head, "ds_id"):  # ZeRO-3: the head's weight is used outside its module's forward
        import deepspeed

        deepspeed.zero.register_external_parameter(model, head)
    return model
