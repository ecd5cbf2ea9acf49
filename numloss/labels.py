"""Labels as a causal LM's inputs give them, aligned with its logits.

A Hugging Face causal LM takes `labels` equal to its `input_ids` (with `ignore_index` where no loss is
wanted) and scores the logits at position t against the label at t + 1. Every caller that holds such
labels (the HF and Megatron adapters, the trainer integration, the recipes' Megatron batches) aligns
them here, so the loss and its counts see the same positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .logit_stats import IGNORE_INDEX


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """HF's causal shift: position t is scored against labels[t + 1]; the last position is ignored.

    Shifting the labels (not slicing the logits) keeps the logits tensor as it is: no copy of a
    [b, s, V_local] tensor."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
