"""DeepSpeed-Ulysses on the DeepSpeed engine (`deepspeed.sp_size`): each row's positions split over sp ranks.

DeepSpeed 0.19.8's own module (`deepspeed.runtime.sequence_parallel.ulysses_sp`) does the attention:
`UlyssesSPAttentionHF.register_with_transformers` builds the groups (sp consecutive ranks per sequence-
parallel group; every rank in one sequence x data-parallel group, over which ZeRO reduces and shards)
and wraps the model's attention kernel (sdpa or flash-attention) so that each layer exchanges heads for
positions (all-to-all), attends over the whole row, and exchanges back. The model's weights are whole on
every rank; nothing else of the model changes.

The rows: every rank of a sequence-parallel group reads the same rows (the data-parallel rank is
rank // sp, the data-parallel size world / sp). The labels are shifted on the whole rows before the
split (`split_batch`), so the label of a slice's last position, the next rank's first token, travels
with it; each rank then keeps its contiguous slice of the input ids and of the positions (Ulysses
gathers the positions to mask causally) and the objective gets a `numloss.sequence_split.SequenceSplit`
of the whole rows (every term exact under the split; counts summed over the data-parallel and the
sequence-parallel ranks once per step). Rows are padded at their end to a multiple of sp (the pad's
labels are ignored; causal attention keeps it out of every real position).

DeepSpeed sums gradients over the sequence x data-parallel group and divides by the data-parallel size
(world / sp): each rank's loss is its share of the global batch's, so the engine multiplies it by
grad_accum x dp as without sp.

Not supported with sp (refused before the model, `recipes.engines.deepspeed.pure.contract.ulysses_problems`
and the data checks of `recipes.checks.preflight`): AutoTP, eager attention, vision models,
mixture-of-experts models, packed rows (Ulysses drops the attention mask and masks by positions only:
packed examples would see each other under sdpa; `split_batch` refuses them too), held-out evaluation
(before the first step, `eval_problem`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from numloss.labels import shift_labels
from numloss.sequence_split import SequenceSplit

from ..pure.contract import ULYSSES_ATTENTION


@dataclass
class SequenceGroup:
    """This rank's place in its sequence-parallel group: `rank` in `[0, size)`, and the group."""

    rank: int
    size: int
    group: object


class Ulysses:
    """The Ulysses attention registered for one run, and how to undo it (`close`): the wrapped kernel goes
    back into transformers' table and DeepSpeed's module-level groups are released, so that a later run
    in the same process starts clean."""

    def __init__(self, model, sp_size: int, micro_batch_size: int, attention: str):
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        if attention not in ULYSSES_ATTENTION:
            raise ValueError(f"deepspeed.sp_size: {sp_size} needs the model's attention in {list(ULYSSES_ATTENTION)}; "
                             f"it runs {attention!r} (model.attn_implementation)")
        self.attention = attention
        self._kernel = ALL_ATTENTION_FUNCTIONS[attention]
        # disable_in_eval: a module in eval mode attends over the rows it is given, unsplit
        self.mpu = UlyssesSPAttentionHF.register_with_transformers(
            model, attention, sp_size, micro_batch_size, seq_length_is_variable=True, disable_in_eval=True)
        group = self.mpu.get_sequence_parallel_group()
        self.sequence = SequenceGroup(dist.get_rank(group), sp_size, group)
        self.data_group = self.mpu.get_sequence_data_parallel_group()

    def close(self) -> None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        ALL_ATTENTION_FUNCTIONS[self.attention] = self._kernel
        self.mpu._release_sequence_parallel_groups()


def split_batch(inputs: dict, sequence: SequenceGroup, ignore_index: int = -100) -> dict:
    """A whole-row micro-batch (`recipes.inputs.batches.model_inputs`: input_ids, labels, attention_mask)
    -> this rank's keyword arguments for the wrapper: its slice of the input ids and positions, labels
    None, and the `sequence_split` holding the whole rows' shifted labels."""
    if "sequence_ids" in inputs or "position_ids" in inputs:
        raise ValueError(f"deepspeed.sp_size: {sequence.size} with packed rows: DeepSpeed-Ulysses masks by positions "
                         "alone, so packed examples would attend to each other; build the shards without "
                         "--pack-length, or use deepspeed.sp_size 1")
    ids, labels, mask = inputs["input_ids"], inputs["labels"], inputs.get("attention_mask")
    if mask is not None and bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise ValueError(f"deepspeed.sp_size: {sequence.size} needs rows padded on the right (Ulysses drops the "
                         "attention mask; causal attention keeps a right pad out of every real position)")
    pad = (-ids.shape[-1]) % sequence.size
    if pad:
        ids = F.pad(ids, (0, pad), value=0)
        labels = F.pad(labels, (0, pad), value=ignore_index)
    split = SequenceSplit.contiguous(shift_labels(labels, ignore_index), sequence.rank, sequence.size, sequence.group)
    positions = torch.arange(ids.shape[-1], device=ids.device).expand(ids.shape[0], -1)
    return {"input_ids": split.local(ids), "labels": None, "position_ids": split.local(positions),
            "sequence_split": split}
