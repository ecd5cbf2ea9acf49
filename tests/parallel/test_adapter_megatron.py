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
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist

from numloss import NumericVocab, Objective
from tests.distributed import run_ranks

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    # megatron-core (the [megatron] extra) is not GPU-only: a missing install fails, never skips.
    raise ImportError("tests/parallel/test_adapter_megatron.py needs megatron-core (pip install -e '.[megatron]')")

V = 64  # Megatron's padded vocab: divisible by TP
DIGIT_IDS = [2, 9, 17, 25, 31, 33, 40, 48, 55, 63]  # digits "0".."9" spread over both shards
B, S, H = 2, 12, 32
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
    from numloss.adapters.megatron import megatron_labels, numeric_loss_func

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
