"""`recipes.engines.megatron.runtime.batches`: the loop's micro-batches -> GPTModel's inputs, in both forms (the
local spec's "mask", the Transformer Engine spec's "thd"), each micro-batch at its own length, and the
guard that refuses attention inputs a spec would not honour. Local; no processes; every expected value
below is written out by hand."""

from __future__ import annotations

import pytest
import torch

from numloss import shift_labels
from recipes.engines.megatron.runtime.batches import check_attention, prepare_window
from recipes.inputs.batches import packed_attention_mask


def _micro(s: int, real: list[int]) -> dict:
    ids = torch.arange(1, 1 + len(real) * s).view(len(real), s)
    mask = (torch.arange(s)[None] < torch.tensor(real)[:, None]).long()
    labels = torch.where(mask.bool(), ids, -100)
    labels[:, 0] = -100
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def _packed() -> dict:
    """Row 0: examples of 3 and 2 tokens, then one padding; row 1: examples of 2 and 4 tokens."""
    m = _micro(6, [5, 6])
    m["sequence_ids"] = torch.tensor([[1, 1, 1, 2, 2, 0], [1, 1, 2, 2, 2, 2]])
    m["position_ids"] = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 0, 1, 2, 3]])
    return m


def test_each_micro_batch_keeps_its_own_length_and_causal_default():
    # the second micro-batch is the longest of the step (7); the first keeps its 3 real columns (of 9),
    # rounded up to the multiple of 4 that sequence parallelism at TP 4 would need
    window = [_micro(9, [3, 2]), _micro(7, [7, 6])]
    out = prepare_window(window, pad_multiple=4)
    assert [tuple(m["input_ids"].shape) for m in out] == [(2, 4), (2, 8)]
    assert [m["tokens_run"] for m in out] == [8, 16]
    for got, given in zip(out, window):
        s = got["input_ids"].shape[1]
        keep = min(s, given["input_ids"].shape[1])
        assert torch.equal(got["labels"][:, :keep], shift_labels(given["labels"])[:, :keep])
        assert (got["labels"][:, keep:] == -100).all() and (got["input_ids"][:, keep:] == 0).all()
        assert torch.equal(got["position_ids"], torch.arange(s).expand(2, s))
        assert got["attention_mask"] is None  # right-padded, unpacked: Megatron's own causal mask
    # nothing scored was cut: every label of the given rows is in the prepared ones
    assert (shift_labels(window[0]["labels"])[:, 4:] == -100).all()


def test_one_length_for_the_interleaved_schedule():
    window = [_micro(9, [3, 2]), _micro(7, [7, 6])]
    out = prepare_window(window, pad_multiple=4, one_length=True)
    assert [tuple(m["input_ids"].shape) for m in out] == [(2, 8), (2, 8)]
    assert out[0]["attention_mask"] is None and (out[0]["labels"][:, 3:] == -100).all()
    thd = prepare_window(window, packing="thd", one_length=True)
    assert [m["packed_seq_params"].cu_seqlens_q.tolist() for m in thd] == [[0, 3, 5, 13], [0, 7, 13]]
    assert [m["tokens_run"] for m in thd] == [13, 13] and thd[0]["sequence_ids"][0, 5:].eq(0).all()


def test_packed_rows_get_the_loops_block_diagonal_mask():
    m = _packed()
    out = prepare_window([m])[0]
    assert torch.equal(out["attention_mask"], ~packed_attention_mask(m["sequence_ids"]))  # Megatron: True = masked
    assert torch.equal(out["sequence_ids"], m["sequence_ids"]) and torch.equal(out["position_ids"], m["position_ids"])


def test_left_padding_masks_padding_keys():
    m = _micro(4, [4, 4])
    m["attention_mask"] = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    mask = prepare_window([m])[0]["attention_mask"]
    assert mask.shape == (2, 1, 4, 4)
    assert mask[0, 0, 2].tolist() == [True, False, False, True]  # not the padding, not the future
    assert not mask.all(-1).any()  # every query sees at least itself


def test_thd_packs_every_example_as_one_sequence():
    m = _packed()
    out = prepare_window([m], pad_multiple=4, packing="thd")[0]
    params = out["packed_seq_params"]
    # 11 real tokens in sequences of 3, 2 (row 0) and 2, 4 (row 1); one padding token makes 12, a
    # multiple of 4, as a sequence of its own
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.dtype == torch.int32 and params.cu_seqlens_q.tolist() == [0, 3, 5, 7, 11, 12]
    assert params.cu_seqlens_kv is params.cu_seqlens_q and params.max_seqlen_q == params.max_seqlen_kv == 4
    assert params.cu_seqlens_q_padded is None
    ids = m["input_ids"]
    assert out["input_ids"].tolist() == [[*ids[0, :5].tolist(), *ids[1].tolist(), 0]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 0, 1, 2, 3, 0]]
    assert out["sequence_ids"].tolist() == [[1, 1, 1, 2, 2, 3, 3, 4, 4, 4, 4, 0]]
    shifted = shift_labels(m["labels"])
    assert out["labels"].tolist() == [[*shifted[0, :5].tolist(), *shifted[1].tolist(), -100]]
    assert out["attention_mask"] is None and out["tokens_run"] == 12


def test_thd_of_unpacked_rows_drops_their_padding():
    m = _micro(5, [3, 5])
    out = prepare_window([m], pad_multiple=2, packing="thd")[0]
    assert out["packed_seq_params"].cu_seqlens_q.tolist() == [0, 3, 8]  # 8 tokens: no padding sequence
    assert out["packed_seq_params"].max_seqlen_q == 5 and out["tokens_run"] == 8
    assert out["input_ids"].tolist() == [[1, 2, 3, 6, 7, 8, 9, 10]]
    # the last token of row 0 predicts nothing (its next token is padding), as in the unpacked row
    assert out["labels"].tolist() == [[2, 3, -100, 7, 8, 9, 10, -100]]
    assert out["sequence_ids"].tolist() == [[1, 1, 1, 2, 2, 2, 2, 2]]


def test_thd_refuses_what_it_cannot_pack():
    m = _packed()
    m["sequence_ids"] = torch.tensor([[1, 1, 2, 1, 1, 0], [1, 1, 2, 2, 2, 2]])
    with pytest.raises(ValueError, match="not contiguous"):
        prepare_window([m], packing="thd")
    m = _packed()
    m["attention_mask"][0, 5] = 1  # a real token in segment 0
    with pytest.raises(ValueError, match="row 0: sequence_ids and attention_mask disagree"):
        prepare_window([m], packing="thd")
    m = _micro(4, [0, 0])
    with pytest.raises(ValueError, match="without a real token"):
        prepare_window([m], packing="thd")
    with pytest.raises(ValueError, match="packing 'bshd'"):
        prepare_window([_micro(4, [4])], packing="bshd")


def test_the_attention_guard():
    packed = _packed()
    as_mask, as_thd = prepare_window([packed])[0], prepare_window([packed], packing="thd")[0]
    check_attention(as_thd, te=True, packing="thd")
    check_attention(as_mask, te=False, packing="mask")
    with pytest.raises(ValueError, match="TE's causal attention ignores it"):
        check_attention(as_mask, te=True, packing="thd")  # the silent cross-attention of a block mask under TE
    with pytest.raises(ValueError, match="with THD sequences"):
        check_attention(as_thd, te=False, packing="mask")
    with pytest.raises(ValueError, match="without THD sequences"):
        check_attention(prepare_window([_micro(4, [4])])[0], te=True, packing="thd")
