"""`recipes.engines.megatron.step.prepare_window`: the loop's micro-batches -> GPTModel's inputs (one
label shift, one length per step, Megatron's attention mask). Local; no processes."""

from __future__ import annotations

import torch

from numloss.adapters.megatron import shift_labels
from recipes.inputs.batches import packed_attention_mask
from recipes.engines.megatron.step import prepare_window


def _micro(s: int, real: list[int]) -> dict:
    ids = torch.arange(1, 1 + len(real) * s).view(len(real), s)
    mask = (torch.arange(s)[None] < torch.tensor(real)[:, None]).long()
    labels = torch.where(mask.bool(), ids, -100)
    labels[:, 0] = -100
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def test_shift_once_pad_to_one_length_and_causal_default():
    window = [_micro(5, [5, 3]), _micro(7, [7, 6])]
    out = prepare_window(window, pad_multiple=4)
    assert [m["input_ids"].shape for m in out] == [(2, 8), (2, 8)]
    for got, given in zip(out, window):
        s = given["input_ids"].shape[1]
        assert torch.equal(got["labels"][:, :s], shift_labels(given["labels"]))
        assert (got["labels"][:, s:] == -100).all() and (got["input_ids"][:, s:] == 0).all()
        assert torch.equal(got["position_ids"], torch.arange(8).expand(2, 8))
        assert got["attention_mask"] is None  # right-padded, unpacked: Megatron's own causal mask


def test_packed_rows_get_the_loops_block_diagonal_mask():
    segments = torch.tensor([[1, 1, 1, 2, 2, 0], [1, 1, 2, 2, 2, 2]])
    m = _micro(6, [5, 6])
    m["sequence_ids"] = segments
    m["position_ids"] = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 0, 1, 2, 3]])
    out = prepare_window([m])[0]
    assert torch.equal(out["attention_mask"], ~packed_attention_mask(segments))  # Megatron: True = masked
    assert torch.equal(out["sequence_ids"], segments) and torch.equal(out["position_ids"], m["position_ids"])


def test_left_padding_masks_padding_keys():
    m = _micro(4, [4, 4])
    m["attention_mask"] = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    mask = prepare_window([m])[0]["attention_mask"]
    assert mask.shape == (2, 1, 4, 4)
    assert mask[0, 0, 2].tolist() == [True, False, False, True]  # not the padding, not the future
    assert not mask.all(-1).any()  # every query sees at least itself
