"""Context parallelism's loss side on the Megatron engine (`megatron.cp_size`): which positions of each row
a context-parallel rank holds, and the step's counts over the data x context-parallel ranks.

megatron-core 0.16.1 splits each row into 2 x cp chunks and gives CP rank r chunks r and 2·cp - 1 - r
(`megatron.core.utils.get_batch_on_this_cp_rank`: causal attention's work is then even over the ranks);
`numloss.sequence_split.SequenceSplit.load_balanced` is that order. The labels are shifted on the whole
rows before the split, every CP rank of a data-parallel replica reads the same rows, and the counts are
each rank's share summed over `get_data_parallel_group(with_context_parallel=True)` once per step. The
model side (Transformer Engine's context-parallel attention) runs on GPUs only; the contract refuses
cp_size > 1 until it is built (`contract.context_parallel_problems`).
"""

from __future__ import annotations

import torch

from numloss import Objective
from numloss.labels import shift_labels
from numloss.normalization import LossCounts, reduce_counts
from numloss.sequence_split import SequenceSplit


def context_parallel_split(labels: torch.Tensor, sequence_ids: torch.Tensor | None = None) -> SequenceSplit:
    """This CP rank's split of whole rows whose `labels` are the model's (unshifted): shifted here, first."""
    from megatron.core import parallel_state

    shifted = shift_labels(labels)
    return SequenceSplit.load_balanced(shifted, parallel_state.get_context_parallel_rank(),
                                       parallel_state.get_context_parallel_world_size(),
                                       parallel_state.get_context_parallel_group(), sequence_ids)


def context_parallel_counts(objective: Objective, window: list[dict]) -> LossCounts:
    """The step's counts: each micro-batch's share on this CP rank, summed over the data x context-parallel
    group in one all-reduce. Every rank calls it once per step, before the first forward."""
    from megatron.core import parallel_state

    shares = []
    for inputs in window:
        split = context_parallel_split(inputs["labels"], inputs.get("sequence_ids"))
        shares.append(objective.counts(split.local(split.labels), sequence_split=split))
    return reduce_counts(shares, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
