"""`numloss.shift_labels`: a causal LM's labels aligned with its logits, the one shift every caller uses."""

from __future__ import annotations

import torch

import numloss
from numloss import shift_labels


def test_position_t_is_scored_against_the_next_label_and_the_last_is_ignored():
    labels = torch.tensor([[5, 6, 7, 8], [-100, 9, -100, 4]])
    expected = torch.tensor([[6, 7, 8, -100], [9, -100, 4, -100]])
    assert torch.equal(shift_labels(labels), expected)
    assert torch.equal(shift_labels(labels, ignore_index=-1)[:, -1], torch.tensor([-1, -1]))
    assert torch.equal(shift_labels(torch.tensor([1, 2])), torch.tensor([2, -100]))  # a single row
    assert torch.equal(labels, torch.tensor([[5, 6, 7, 8], [-100, 9, -100, 4]]))  # the input is left as it was


def test_the_adapters_and_the_trainer_integration_shift_with_it():
    from numloss.adapters import deepspeed_autotp, hf
    from numloss.integrations import hf_trainer

    assert "shift_labels" in numloss.__all__
    for module in (deepspeed_autotp, hf, hf_trainer):
        assert module.shift_labels is numloss.shift_labels, module.__name__
