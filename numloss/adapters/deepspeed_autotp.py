"""numloss on DeepSpeed AutoTP with a vocab-parallel lm_head (Hugging Face causal LMs).

How DeepSpeed 0.19.8 leaves the logits split (read from its source):

- Config: `"tensor_parallel": {"autotp_size": T, "vocab_parallel_lm_head": true}`
  (`deepspeed/runtime/tensor_parallel/config.py`, `TPTrainingConfig.vocab_parallel_lm_head`; None follows
  an HF tied-embedding `tp_plan`, False keeps full logits).
- `DeepSpeedEngine._apply_autotp_partitioning` (`deepspeed/runtime/engine.py`) builds an `AutoTP` with
  `vocab_parallel_lm_head=True`; `AutoTP._replace_vocab_parallel_lm_head` (`module_inject/auto_tp.py`)
  swaps the `nn.Linear` named `lm_head` / `embed_out` for `VocabParallelLinear`
  (`module_inject/layers.py`): a column-parallel linear with `gather_output=False` that carries
  `is_vocab_parallel_lm_head = True`, `mp_group` (the TP group), `vocab_start_index`,
  `vocab_end_index` and `vocab_size` (the shards may be uneven: `_partition_sizes`).
- `finalize_autotp` then calls `deepspeed.sequence.cross_entropy.configure_vocab_parallel_loss`, which
  replaces the HF model's `loss_function` with a `VocabParallelCausalLMLoss` (plain CE only).

This module reads the TP group and the vocab range from that `VocabParallelLinear` (identified by its
attributes, so importing this module never imports deepspeed), computes the numloss objective on the
split logits, and can install the objective as the model's `loss_function` in place of DeepSpeed's CE
(the same hook DeepSpeed uses), so `engine(input_ids, labels=labels).loss` is the numeric objective.

Without a vocab-parallel head (TP = 1, or AutoTP with a gathered head) the logits are the full
vocabulary and `find_vocab_shard` returns a shard with no group: the same code runs densely.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..labels import shift_labels
from ..logit_stats import IGNORE_INDEX
from ..normalization import LossCounts
from ..objective import Objective, ObjectiveOutput


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice `[start, end)` of a `vocab_size` vocabulary, and the TP group (None: dense)."""

    group: object
    start: int
    end: int
    vocab_size: int

    @property
    def local_size(self) -> int:
        return self.end - self.start


def _unwrap(model):
    """The HF model inside a DeepSpeed engine or a DDP wrapper (or the model itself).

    A DeepSpeed engine forwards unknown attributes to its module, so `hasattr` cannot tell them apart:
    unwrap by type name (no deepspeed import)."""
    while type(model).__name__ in ("DeepSpeedEngine", "PipelineEngine", "DistributedDataParallel"):
        model = model.module
    return model


def find_vocab_parallel_head(model):
    """The DeepSpeed `VocabParallelLinear` lm_head of `model` (an engine or its module), or None."""
    heads = [m for m in _unwrap(model).modules() if getattr(m, "is_vocab_parallel_lm_head", False)]
    if len(heads) > 1:
        raise ValueError(f"found {len(heads)} vocab-parallel LM heads; expected at most one")
    return heads[0] if heads else None


def find_vocab_shard(model) -> VocabShard:
    """The TP group and this rank's vocab range of the logits `model` returns.

    With a DeepSpeed vocab-parallel lm_head: its `mp_group` and `[vocab_start_index, vocab_end_index)`.
    Otherwise the logits are full: no group, `[0, V)` with V the output embedding's rows (before AutoTP
    split a gathered head, before ZeRO-3 partitioned it) or `config.vocab_size`.
    """
    head = find_vocab_parallel_head(model)
    if head is not None:
        group = head.mp_group
        import torch.distributed as dist  # a group exists only when torch.distributed is initialised

        if group is not None and dist.get_world_size(group) == 1:
            group = None
        return VocabShard(group, int(head.vocab_start_index), int(head.vocab_end_index), int(head.vocab_size))
    inner = _unwrap(model)
    out = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if getattr(out, "_orig_weight_shape", None) is not None:
        # an AutoTP LinearLayer that gathers its output: its weight is a TP shard, its logits are full
        vocab_size = int(out._orig_weight_shape[0])
    elif out is not None and getattr(out, "weight", None) is not None:
        weight = out.weight
        vocab_size = int(getattr(weight, "ds_shape", weight.shape)[0])  # ZeRO-3 keeps the full shape here
    else:
        vocab_size = int(inner.config.vocab_size)
    return VocabShard(None, 0, vocab_size, vocab_size)


def causal_lm_objective(
    objective: Objective,
    logits: torch.Tensor,
    labels: torch.Tensor | None = None,
    shard: VocabShard | None = None,
    *,
    shifted_labels: torch.Tensor | None = None,
    counts: LossCounts | None = None,
    sequence_ids: torch.Tensor | None = None,
    diagnostics: bool | None = None,
) -> ObjectiveOutput:
    """The objective on a causal LM's logits `[b, s, V_local]` (this rank's vocab shard).

    Give `labels` [b, s] as the model's inputs (unshifted; shifted here as HF does) or `shifted_labels`
    already aligned with the logits. `shard` (from `find_vocab_shard`) names the TP group and this
    rank's `vocab_start`; None means full logits. The result is identical on every TP rank and equals
    the dense objective on the gathered logits. `counts`, `sequence_ids` and `diagnostics` as `Objective.__call__`.
    """
    if (labels is None) == (shifted_labels is None):
        raise ValueError("give exactly one of labels (unshifted) and shifted_labels")
    if shifted_labels is None:
        shifted_labels = shift_labels(labels, objective.config.ignore_index)
    shard = shard or VocabShard(None, 0, logits.shape[-1], logits.shape[-1])
    if logits.shape[-1] != shard.local_size:
        raise ValueError(f"logits have {logits.shape[-1]} vocab columns but this rank's shard is"
                         f" [{shard.start}, {shard.end}): pass the shard of the model that made them")
    if shard.group is not None and shard.vocab_size != objective.vocab.vocab_size:
        raise ValueError(f"the model's vocabulary has {shard.vocab_size} rows but the objective's numeric"
                         f" vocabulary was built for {objective.vocab.vocab_size}")
    return objective(logits, shifted_labels.to(logits.device), group=shard.group, vocab_start=shard.start,
                     counts=counts, sequence_ids=sequence_ids, diagnostics=diagnostics)


class NumericCausalLMLoss:
    """A Hugging Face `loss_function` computing the numloss objective on (possibly vocab-split) logits.

    Signature as HF's `ForCausalLMLoss` / DeepSpeed's `VocabParallelCausalLMLoss`:
    `(logits, labels=None, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
    shift_labels=None, **kwargs) -> loss`. The last `ObjectiveOutput` is kept in `.last` for logging
    (`.last.log_dict()`).

    `num_items_in_batch`, the step's normaliser:
    - a `LossCounts` (every denominator of the step, `numloss.normalization`): every term divides by
      its own count over the step, so the micro-batches' losses add up to the whole batch's exactly.
      With the HF Trainer or TRL's SFTTrainer use `numloss.integrations.hf_trainer` instead, which
      makes these counts in the Trainer's public `get_batch_samples` and is tested with the real classes;
    - a number (the HF Trainer's own: the valid tokens of the whole accumulated batch): CE divides by
      it exactly; the numeric terms, which need counts the Trainer does not make, are divided by this
      micro-batch's own counts and weighted by its share of the valid tokens.
    """

    def __init__(self, objective: Objective, shard: VocabShard):
        self.objective = objective
        self.shard = shard
        self.last: ObjectiveOutput | None = None

    def __call__(self, logits, labels=None, vocab_size=None, num_items_in_batch=None, ignore_index=IGNORE_INDEX,
                 shift_labels=None, **kwargs):
        if ignore_index != self.objective.config.ignore_index:
            raise ValueError(f"ignore_index {ignore_index} differs from the objective's"
                             f" {self.objective.config.ignore_index}")
        step_counts = num_items_in_batch if isinstance(num_items_in_batch, LossCounts) else None
        out = causal_lm_objective(self.objective, logits, labels, self.shard, shifted_labels=shift_labels,
                                  counts=step_counts)
        self.last = out
        loss = out.loss
        if num_items_in_batch is not None and step_counts is None:
            aligned = shift_labels if shift_labels is not None else labels[..., 1:]
            valid = (aligned != ignore_index).sum().to(loss.dtype)
            loss = loss * valid / torch.as_tensor(num_items_in_batch, device=loss.device, dtype=loss.dtype).clamp_min(1)
        return loss


def install_numeric_loss(model, objective: Objective) -> NumericCausalLMLoss:
    """Make `model(input_ids, labels=labels).loss` (an engine or its HF module) the numloss objective.

    Replaces the HF `loss_function` (DeepSpeed's `VocabParallelCausalLMLoss` under a vocab-parallel
    head) with a `NumericCausalLMLoss` bound to this rank's shard; the replaced function stays in
    `model._numloss_original_loss_function`. Call after `deepspeed.initialize` (AutoTP installs its own
    loss during initialisation). Returns the installed callable.
    """
    inner = _unwrap(model)
    if not hasattr(inner, "loss_function"):
        raise ValueError(f"{type(inner).__name__} has no loss_function hook to replace")
    shard = find_vocab_shard(inner)
    loss_fn = NumericCausalLMLoss(objective, shard)
    original = inner.loss_function
    inner.loss_function = loss_fn
    if inner.loss_function is not loss_fn:
        inner.loss_function = original
        raise ValueError(f"{type(inner).__name__}.loss_function could not be replaced")
    if not hasattr(inner, "_numloss_original_loss_function"):
        inner._numloss_original_loss_function = original
    return loss_fn
