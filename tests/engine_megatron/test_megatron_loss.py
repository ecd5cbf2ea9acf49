"""`numloss.adapters.megatron.numeric_loss_func` with step-global counts, driven the way megatron-core's
schedules drive it with `calculate_per_token_loss=True` (each micro-batch's returned value is
backpropagated as it is; gradients are summed over micro-batches and DP ranks and divided by the
global sum of the returned token counts), equals the objective on the whole global batch at once:
value, every logged term, and the gradient of every logit. 4 gloo processes: DP 2 x TP 2 (vocab
shards), 3 micro-batches per DP rank of different fill (one with no numeric label, one fully ignored),
packed rows (sequence ids) so NTIL counts examples, DIST2 with place-value weighting. In the same
spawn: Megatron's padded vocabulary columns are kept out of the objective (`real_vocab_size`)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist

from numloss import NumericVocab, Objective, shift_labels
from numloss.adapters.megatron import megatron_labels, numeric_loss_func
from numloss.normalization import reduce_counts
from tests.distributed import run_ranks

V, B, S, MICRO, DP, TP = 64, 2, 10, 3, 2, 2
DIGIT_IDS = [2, 9, 17, 25, 31, 33, 40, 48, 55, 63]  # digits over both vocab shards
CONFIG = {"terms": {"smmd": {}, "ntl_was": {}, "ntil": {"noise_scale": 0.0},
                    "dist2": {"weighting": "place_value"}}}


def _micro_batch(dp_rank: int, index: int) -> dict[str, torch.Tensor]:
    """Unshifted (HF-style) labels, sequence ids and full-vocab logits of one micro-batch."""
    g = torch.Generator().manual_seed(100 * dp_rank + index)
    digits, text = torch.tensor(DIGIT_IDS), torch.tensor([t for t in range(V) if t not in DIGIT_IDS])
    labels = text[torch.randint(len(text), (B, S), generator=g)]
    if index != 1:  # micro-batch 1: text only
        labels[0, 3:6] = digits[torch.randint(10, (3,), generator=g)]
        labels[1, 6 + dp_rank:9] = digits[torch.randint(10, (3 - dp_rank,), generator=g)]
    labels[:, :2] = -100  # a prompt
    if dp_rank == 1 and index == 2:
        labels[:] = -100  # nothing scored in this micro-batch
    sequence_ids = torch.ones(B, S, dtype=torch.long)
    sequence_ids[0, 5:] = 2  # row 0 packs two examples
    logits = 3 * torch.randn(B, S, V, generator=g)
    return {"labels": labels, "sequence_ids": sequence_ids, "logits": logits}


def _check(rank: int, world: int) -> None:
    dp_rank, tp_rank = divmod(rank, TP)
    tp_groups = [dist.new_group([d * TP + t for t in range(TP)]) for d in range(DP)]
    dp_groups = [dist.new_group([d * TP + t for d in range(DP)]) for t in range(TP)]
    tp_group, dp_group = tp_groups[dp_rank], dp_groups[tp_rank]
    objective = Objective(NumericVocab(DIGIT_IDS, list(range(10)), vocab_size=V), CONFIG)
    v_local = V // TP
    shard = slice(tp_rank * v_local, (tp_rank + 1) * v_local)

    window = [_micro_batch(dp_rank, i) for i in range(MICRO)]
    counts = reduce_counts([objective.counts(shift_labels(m["labels"]), m["sequence_ids"]) for m in window],
                           group=dp_group)
    leaves, tokens, reports = [], torch.zeros([], dtype=torch.int), []
    for m in window:  # what the schedules do with calculate_per_token_loss=True
        local = m["logits"][..., shard].clone().requires_grad_(True)
        loss_func = partial(numeric_loss_func, objective, counts, shift_labels(m["labels"]),
                            sequence_ids=m["sequence_ids"], group=tp_group)
        value, n, report = loss_func(local)
        assert n.dtype == torch.int and set(report) == {"loss", "ce", "numeric_positions", *(
            f"term/{k}" for k in CONFIG["terms"])}
        value.backward()
        leaves.append(local)
        tokens += n
        reports.append(report)
    dist.all_reduce(tokens, group=dp_group)  # finalize_model_grads: the global token count
    assert int(tokens) == counts["tokens"]
    grads = [leaf.grad / tokens for leaf in leaves]
    logged = {k: torch.tensor(sum(r[k] for r in reports), dtype=torch.float64) for k in reports[0]}
    for value in logged.values():
        dist.all_reduce(value, group=dp_group)

    # The reference: every micro-batch of every DP rank in one dense batch, on one process.
    everything = [_micro_batch(d, i) for d in range(DP) for i in range(MICRO)]
    full = torch.cat([m["logits"] for m in everything]).requires_grad_(True)
    dense = objective(full, shift_labels(torch.cat([m["labels"] for m in everything])),
                      sequence_ids=torch.cat([m["sequence_ids"] for m in everything]))
    dense.loss.backward()
    expected = dense.log_dict()
    assert expected["numeric_positions"] > 0 and all(abs(v) > 1e-4 for k, v in expected.items() if k.startswith("term/"))
    for key, value in expected.items():
        torch.testing.assert_close(logged[key].item(), float(value), rtol=1e-5, atol=1e-7, msg=f"rank {rank} {key}")
    mine = full.grad[dp_rank * MICRO * B:(dp_rank + 1) * MICRO * B, :, shard].split(B)
    for i, (got, want) in enumerate(zip(grads, mine)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-8, msg=f"rank {rank} micro {i} grad")
    _check_padded_vocab(rank, tp_group, tp_rank)


def _check_padded_vocab(rank: int, tp_group, tp_rank: int) -> None:
    """Megatron pads the vocabulary (zero rows): with `real_vocab_size` the padded columns leave every
    softmax, so the loss and gradient are those of the unpadded logits; the padding may sit inside a
    shard (real 56 of 64) or fill one (real 28: TP rank 1 holds only padding)."""
    digits = [2, 5, 9, 11, 14, 17, 20, 23, 25, 27]
    config = {**CONFIG, "terms": {**CONFIG["terms"], "gce": {"weight": 0.5}}, "z_loss": 1e-4}
    v_local = V // TP
    for real in (56, 28):
        g = torch.Generator().manual_seed(real)
        full = 3 * torch.randn(B, S, V, generator=g)
        labels = torch.randint(0, real, (B, S), generator=g)
        labels[0, 2:5] = torch.tensor(digits[:3])
        labels[1, :2] = -100
        dense_objective = Objective(NumericVocab(digits, list(range(10)), vocab_size=real), config)
        counts = dense_objective.counts(labels)
        unpadded = full[..., :real].clone().requires_grad_(True)
        dense = dense_objective(unpadded, labels, counts=counts)
        dense.loss.backward()
        objective = Objective(NumericVocab(digits, list(range(10)), vocab_size=V), config)
        leaf = full[..., tp_rank * v_local:(tp_rank + 1) * v_local].clone().requires_grad_(True)
        value, _, report = numeric_loss_func(objective, counts, labels, leaf * 1.0, group=tp_group,
                                             real_vocab_size=real)
        (value / counts["tokens"]).backward()
        where = f"rank {rank} real vocab {real}"
        torch.testing.assert_close(float(value) / counts["tokens"], float(dense.loss), rtol=1e-5, atol=0, msg=where)
        assert report == pytest.approx(dense.log_dict(), rel=1e-5), where
        want = torch.cat([unpadded.grad, torch.zeros(B, S, V - real)], -1)[..., tp_rank * v_local:(tp_rank + 1) * v_local]
        torch.testing.assert_close(leaf.grad, want, rtol=1e-5, atol=1e-8, msg=where)


def test_step_global_loss_func_matches_dense_global_batch():
    run_ranks(DP * TP, _check, timeout=180)


def test_labels_shift_once_and_megatron_form():
    labels = torch.tensor([[-100, -100, 5, 6, 7], [-100, 3, 4, -100, -100]])
    shifted = shift_labels(labels)
    assert shifted.tolist() == [[-100, 5, 6, 7, -100], [3, 4, -100, -100, -100]]
    ids, mask = megatron_labels(shifted)
    assert ids.tolist() == [[0, 5, 6, 7, 0], [3, 4, 0, 0, 0]]
    assert mask.dtype == torch.float32 and mask.tolist() == [[0, 1, 1, 1, 0], [1, 1, 0, 0, 0]]
