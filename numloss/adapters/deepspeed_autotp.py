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
attributes, so importing this module never imports deepspeed) and computes the numloss objective on the
split logits (`causal_lm_objective`). A model trains with it through `numloss.adapters.hf`:
`numeric_autotp_model(model, objective)` before `deepspeed.initialize` makes the HF model's own forward
return the objective (logits or chunked head), with the model's config, `tp_plan` and module names left
as AutoTP needs them; DeepSpeed's CE stays installed in the `loss_function` hook, unused.

Without a vocab-parallel head (TP = 1, or AutoTP with a gathered head) the logits are the full
vocabulary and `find_vocab_shard` returns a shard with no group: the same code runs densely.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..labels import shift_labels
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
    sequence_split=None,
) -> ObjectiveOutput:
    """The objective on a causal LM's logits `[b, s, V_local]` (this rank's vocab shard).

    Give `labels` [b, s] as the model's inputs (unshifted; shifted here as HF does) or `shifted_labels`
    already aligned with the logits. `shard` (from `find_vocab_shard`) names the TP group and this
    rank's `vocab_start`; None means full logits. The result is identical on every TP rank and equals
    the dense objective on the gathered logits. `counts`, `sequence_ids`, `diagnostics` and `sequence_split` as
    `Objective.__call__`.
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
                     counts=counts, sequence_ids=sequence_ids, diagnostics=diagnostics, sequence_split=sequence_split)
