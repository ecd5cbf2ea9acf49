"""megatron-core GPTModel at TP 2 with `parallel_output=True`, its vocab-parallel logits through
`numloss.adapters.megatron.numeric_loss_func` (the loss_func `recipes.engines.megatron` trains with):
the loss as megatron-core's schedules and `finalize_model_grads` make it (the returned value over the
returned token count) equals the numloss objective on the gathered logits (value, terms and parameter
gradients), and the CE part equals megatron-core's own `vocab_parallel_cross_entropy` on the labels
`megatron_labels` gives it. Real gloo processes on the CPU.

GPTModel on a CPU needs two redirections (nothing else): `torch.cuda.current_device` (its global
memory buffer for attention scores) and its RNG tracker's get/set state (attention dropout runs inside
`get_cuda_rng_tracker().fork()` even at p = 0); and an explicit causal attention mask, since its
default mask is built with `device="cuda"`.

`numloss.adapters.megatron.numeric_loss_func` with step-global counts, driven the way megatron-core's
schedules drive it with `calculate_per_token_loss=True` (each micro-batch's returned value is
backpropagated as it is; gradients are summed over micro-batches and DP ranks and divided by the
global sum of the returned token counts), equals the objective on the whole global batch at once:
value, every logged term, and the gradient of every logit. 4 gloo processes: DP 2 x TP 2 (vocab
shards), 3 micro-batches per DP rank of different fill (one with no numeric label, one fully ignored),
packed rows (sequence ids) so NTIL counts examples, DIST2 with place-value weighting. In the same
spawn: Megatron's padded vocabulary columns are kept out of the objective (`real_vocab_size`).
"""

from __future__ import annotations

import importlib.util
from functools import partial

import pytest
import torch
import torch.distributed as dist

from numloss import NumericVocab, Objective, shift_labels
from numloss.adapters.megatron import megatron_labels, numeric_loss_func
from numloss.normalization import reduce_counts
from tests.distributed import run_ranks

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    # megatron-core (the [megatron] extra) is not GPU-only: a missing install fails, never skips.
    raise ImportError("tests/numloss/adapters/test_megatron.py needs megatron-core (pip install -e '.[megatron]')")

V = 64  # Megatron's padded vocab: divisible by TP
DIGIT_IDS = [2, 9, 17, 25, 31, 33, 40, 48, 55, 63]  # digits "0".."9" spread over both shards
B, S, H = 2, 12, 32
MICRO, DP, TP, STEP_S = 3, 2, 2, 10  # the step-global checks: micro-batches per DP rank, DP x TP, length
CONFIG = {
    "terms": {"smmd": {}, "ntl_was": {}, "ntil": {"noise_scale": 0.0},
              "dist2": {"weighting": "place_value"}, "gce": {"weight": 0.5}},
    "z_loss": 1e-4,
}


def _megatron_on_cpu(seed: int) -> None:
    import megatron.core.tensor_parallel.random as mrandom

    torch.cuda.current_device = lambda: torch.device("cpu")
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.states_[mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME] = torch.Generator().manual_seed(seed).get_state()


def _build(world):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    _megatron_on_cpu(seed=123)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=H, num_attention_heads=4, use_cpu_initialization=True,
                               hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=world)
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=V, max_sequence_length=32,
                    parallel_output=True, share_embeddings_and_output_weights=False)


def _batch(with_numbers=True):
    g = torch.Generator().manual_seed(5)
    digits = torch.tensor(DIGIT_IDS)
    text = torch.tensor([t for t in range(V) if t not in DIGIT_IDS])
    tokens = text[torch.randint(len(text), (B, S + 1), generator=g)]
    if with_numbers:
        tokens[0, 4:7] = digits[torch.randint(10, (3,), generator=g)]  # a three-digit number
        tokens[0, 9] = digits[4]
        tokens[1, 2:4] = digits[torch.randint(10, (2,), generator=g)]
        tokens[1, 10:13] = digits[torch.randint(10, (3,), generator=g)]  # runs into the padded tail
    ids, labels = tokens[:, :-1], tokens[:, 1:]  # Megatron's labels: already shifted, no ignore index
    loss_mask = torch.ones(B, S)
    loss_mask[0, :2] = 0  # a prompt
    loss_mask[1, 11:] = 0  # padding: cuts the last number short
    return ids, labels, loss_mask


def _check_tp(rank, world):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from numloss import compute_logit_stats

    model = _build(world)
    try:
        vocab = NumericVocab(DIGIT_IDS, list(range(10)), vocab_size=V)
        assert vocab.is_digits()
        objective = Objective(vocab, CONFIG)
        position_ids = torch.arange(S)[None].expand(B, S)
        causal = torch.triu(torch.ones(1, 1, S, S), diagonal=1).bool()
        v_local = V // world
        start = rank * v_local
        tp_group = parallel_state.get_tensor_model_parallel_group()

        for with_numbers in (True, False):
            ids, labels, loss_mask = _batch(with_numbers)
            shifted = torch.where(loss_mask.bool(), labels, -100)  # the training loop's labels: -100 not scored
            counts = objective.counts(shifted)  # the step's counts: one micro-batch on one data-parallel rank
            where = f"rank {rank} numbers={with_numbers}"
            model.zero_grad()
            local = model(ids, position_ids, causal)  # no labels: [b, s, V/tp]
            assert local.shape == (B, S, v_local)
            value, n, report = numeric_loss_func(objective, counts, shifted, local)
            assert n.dtype == torch.int and int(n) == int(loss_mask.sum())
            loss = value / n  # what the schedules and finalize_model_grads make of it: / the step's tokens
            loss.backward()
            grads = {name: p.grad.clone() for name, p in model.named_parameters()}
            assert all(torch.isfinite(g).all() for g in grads.values())
            assert grads["output_layer.weight"].shape == (v_local, H) and grads["output_layer.weight"].abs().sum() > 0
            assert grads["embedding.word_embeddings.weight"].abs().sum() > 0  # through every layer

            # Reference: gather the logits, run numloss densely, push each rank's slice of the gradient
            # back through the same model.
            model.zero_grad()
            local = model(ids, position_ids, causal)
            parts = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(parts, local.detach().contiguous(), group=tp_group)
            full = torch.cat(parts, dim=-1).requires_grad_(True)
            dense = objective(full, shifted)
            dense.loss.backward()
            local.backward(full.grad[..., start:start + v_local])

            tol = dict(rtol=1e-5, atol=1e-5)
            expected_numeric = int((torch.isin(labels, torch.tensor(DIGIT_IDS)) & loss_mask.bool()).sum())
            assert report["numeric_positions"] == dense.numeric_positions == expected_numeric
            assert expected_numeric == (8 if with_numbers else 0)
            torch.testing.assert_close(loss, dense.loss, **tol, msg=lambda m: f"{where} loss: {m}")
            assert report["loss"] == pytest.approx(float(dense.loss), rel=1e-5)
            assert report["ce"] == pytest.approx(float(dense.ce), rel=1e-5)
            for name, term in dense.terms.items():
                assert report[f"term/{name}"] == pytest.approx(float(term), rel=1e-5, abs=1e-5), f"{where} {name}"
                if with_numbers and name != "gce":
                    assert term.abs() > 1e-3, name  # every numeric term is live
            if with_numbers:
                assert (loss - dense.ce).abs() > 1e-2  # the numeric terms move the total
            for name, p in model.named_parameters():
                torch.testing.assert_close(grads[name], p.grad, **tol, msg=lambda m: f"{where} grad {name}: {m}")

            # The CE part against megatron-core's own vocab-parallel CE (it overwrites fp32 input: a clone),
            # given Megatron's form of the labels (no ignore index, a loss mask).
            megatron_ids, mask = megatron_labels(shifted)
            assert torch.equal(mask, loss_mask) and torch.equal(megatron_ids[mask.bool()], labels[loss_mask.bool()])
            logits_sbv = local.detach().transpose(0, 1).contiguous()
            megatron_ce = vocab_parallel_cross_entropy(logits_sbv.clone(), megatron_ids.t().contiguous()).t()
            valid = loss_mask.bool()
            ce = compute_logit_stats(local.detach(), shifted, vocab, tp_group, start, numeric=False).ce_per_token
            ce = ce.view(B, S)
            torch.testing.assert_close(ce[valid], megatron_ce[valid], **tol)
            assert (ce[~valid] == 0).all()
            ce_only = Objective(vocab, {"terms": {}})
            _, _, ce_report = numeric_loss_func(ce_only, ce_only.counts(shifted), shifted, local.detach().clone())
            assert ce_report["ce"] == pytest.approx(float(megatron_ce[valid].mean()), rel=1e-5)

        with pytest.raises(ValueError, match="padded vocab"):  # shards that do not tile the numeric vocabulary
            numeric_loss_func(objective, counts, shifted, local.detach()[..., :-1])
    finally:
        parallel_state.destroy_model_parallel()


def test_gpt_model_tp2_matches_dense_and_megatron_ce():
    run_ranks(2, _check_tp)


# ---- the step's global counts over micro-batches and data-parallel ranks (DP 2 x TP 2) ----

STEP_CONFIG = {"terms": {"smmd": {}, "ntl_was": {}, "ntil": {"noise_scale": 0.0},
                         "dist2": {"weighting": "place_value"}}}


def _micro_batch(dp_rank: int, index: int) -> dict[str, torch.Tensor]:
    """Unshifted (HF-style) labels, sequence ids and full-vocab logits of one micro-batch."""
    g = torch.Generator().manual_seed(100 * dp_rank + index)
    digits, text = torch.tensor(DIGIT_IDS), torch.tensor([t for t in range(V) if t not in DIGIT_IDS])
    labels = text[torch.randint(len(text), (B, STEP_S), generator=g)]
    if index != 1:  # micro-batch 1: text only
        labels[0, 3:6] = digits[torch.randint(10, (3,), generator=g)]
        labels[1, 6 + dp_rank:9] = digits[torch.randint(10, (3 - dp_rank,), generator=g)]
    labels[:, :2] = -100  # a prompt
    if dp_rank == 1 and index == 2:
        labels[:] = -100  # nothing scored in this micro-batch
    sequence_ids = torch.ones(B, STEP_S, dtype=torch.long)
    sequence_ids[0, 5:] = 2  # row 0 packs two examples
    logits = 3 * torch.randn(B, STEP_S, V, generator=g)
    return {"labels": labels, "sequence_ids": sequence_ids, "logits": logits}


def _check_step_global(rank: int, world: int) -> None:
    dp_rank, tp_rank = divmod(rank, TP)
    tp_groups = [dist.new_group([d * TP + t for t in range(TP)]) for d in range(DP)]
    dp_groups = [dist.new_group([d * TP + t for d in range(DP)]) for t in range(TP)]
    tp_group, dp_group = tp_groups[dp_rank], dp_groups[tp_rank]
    objective = Objective(NumericVocab(DIGIT_IDS, list(range(10)), vocab_size=V), STEP_CONFIG)
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
            f"term/{k}" for k in STEP_CONFIG["terms"])}
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
    config = {**STEP_CONFIG, "terms": {**STEP_CONFIG["terms"], "gce": {"weight": 0.5}}, "z_loss": 1e-4}
    v_local = V // TP
    for real in (56, 28):
        g = torch.Generator().manual_seed(real)
        full = 3 * torch.randn(B, STEP_S, V, generator=g)
        labels = torch.randint(0, real, (B, STEP_S), generator=g)
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
        want = torch.cat([unpadded.grad, torch.zeros(B, STEP_S, V - real)], -1)[..., tp_rank * v_local:(tp_rank + 1) * v_local]
        torch.testing.assert_close(leaf.grad, want, rtol=1e-5, atol=1e-8, msg=where)


def test_step_global_loss_func_matches_dense_global_batch():
    run_ranks(DP * TP, _check_step_global, timeout=180)


def test_labels_shift_once_and_megatron_form():
    labels = torch.tensor([[-100, -100, 5, 6, 7], [-100, 3, 4, -100, -100]])
    shifted = shift_labels(labels)
    assert shifted.tolist() == [[-100, 5, 6, 7, -100], [3, 4, -100, -100, -100]]
    ids, mask = megatron_labels(shifted)
    assert ids.tolist() == [[0, 5, 6, 7, 0], [3, 4, 0, 0, 0]]
    assert mask.dtype == torch.float32 and mask.tolist() == [[0, 1, 1, 1, 0], [1, 1, 0, 0, 0]]
