"""megatron-core GPTModel at TP 2 with `parallel_output=True` and numloss installed as its
`compute_language_model_loss`: Megatron's masked mean of the per-token output equals the numloss
objective on the gathered logits (value, terms and parameter gradients), and the CE part equals
megatron-core's own `vocab_parallel_cross_entropy`. Real gloo processes on the CPU.

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

    from numloss.adapters.megatron import install_numeric_loss

    model = _build(world)
    try:
        vocab = NumericVocab(DIGIT_IDS, list(range(10)), vocab_size=V)
        assert vocab.is_digits()
        objective = Objective(vocab, CONFIG)
        hook = install_numeric_loss(model, objective)
        position_ids = torch.arange(S)[None].expand(B, S)
        causal = torch.triu(torch.ones(1, 1, S, S), diagonal=1).bool()
        v_local = V // world
        start = rank * v_local

        for with_numbers in (True, False):
            ids, labels, loss_mask = _batch(with_numbers)
            where = f"rank {rank} numbers={with_numbers}"
            model.zero_grad()
            per_token = model(ids, position_ids, causal, labels=labels, loss_mask=loss_mask)
            assert per_token.shape == (B, S)
            assert (per_token[loss_mask == 0] == 0).all()
            loss = (per_token * loss_mask).sum() / loss_mask.sum()  # Megatron's loss_func reduction
            loss.backward()
            grads = {name: p.grad.clone() for name, p in model.named_parameters()}
            assert all(torch.isfinite(g).all() for g in grads.values())
            assert grads["output_layer.weight"].shape == (v_local, H) and grads["output_layer.weight"].abs().sum() > 0
            assert grads["embedding.word_embeddings.weight"].abs().sum() > 0  # through every layer
            out = hook.last.output

            # Reference: gather the logits, run numloss densely, push each rank's slice of the gradient
            # back through the same model.
            model.zero_grad()
            local = model(ids, position_ids, causal)  # no labels: [b, s, V/tp]
            assert local.shape == (B, S, v_local)
            parts = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(parts, local.detach().contiguous(), group=parallel_state.get_tensor_model_parallel_group())
            full = torch.cat(parts, dim=-1).requires_grad_(True)
            dense_labels = torch.where(loss_mask.bool(), labels, -100)
            dense = objective(full, dense_labels)
            dense.loss.backward()
            local.backward(full.grad[..., start:start + v_local])

            tol = dict(rtol=1e-5, atol=1e-5)
            expected_numeric = int((torch.isin(labels, torch.tensor(DIGIT_IDS)) & loss_mask.bool()).sum())
            assert out.numeric_positions == dense.numeric_positions == expected_numeric
            assert expected_numeric == (8 if with_numbers else 0)
            torch.testing.assert_close(loss, dense.loss, **tol, msg=lambda m: f"{where} loss: {m}")
            torch.testing.assert_close(out.loss, dense.loss, **tol)
            torch.testing.assert_close(out.ce, dense.ce, **tol)
            for name, value in dense.terms.items():
                torch.testing.assert_close(out.terms[name], value, **tol, msg=lambda m: f"{where} {name}: {m}")
                if with_numbers and name != "gce":
                    assert value.abs() > 1e-3, name  # every numeric term is live
            if with_numbers:
                assert (loss - out.ce).abs() > 1e-2  # the numeric terms move the total
            for name, p in model.named_parameters():
                torch.testing.assert_close(grads[name], p.grad, **tol, msg=lambda m: f"{where} grad {name}: {m}")

            # The CE part against megatron-core's own vocab-parallel CE (it overwrites fp32 input: a clone).
            logits_sbv = local.detach().transpose(0, 1).contiguous()
            megatron_ce = vocab_parallel_cross_entropy(logits_sbv.clone(), labels.t().contiguous()).t()
            valid = loss_mask.bool()
            torch.testing.assert_close(hook.last.ce_per_token[valid], megatron_ce[valid], **tol)
            assert (hook.last.ce_per_token[~valid] == 0).all()
    finally:
        parallel_state.destroy_model_parallel()


def test_gpt_model_tp2_matches_dense_and_megatron_ce():
    run_ranks(2, _check_tp)


def _check_language_model_loss_direct(rank, world):
    # The function itself, without a model: [s, b, V/tp] shards of random logits vs the dense objective.
    from numloss.adapters.megatron import language_model_loss

    group = dist.group.WORLD
    vocab = NumericVocab(DIGIT_IDS, list(range(10)), vocab_size=V)
    objective = Objective(vocab, CONFIG)
    g = torch.Generator().manual_seed(3)
    full = 3 * torch.randn(S, B, V, generator=g)
    _, labels, loss_mask = _batch()
    v_local = V // world
    local = full[..., rank * v_local:(rank + 1) * v_local].clone().requires_grad_(True)
    result = language_model_loss(objective, labels, local, loss_mask, group=group)
    ((result.per_token * loss_mask).sum() / loss_mask.sum()).backward()
    dense_in = full.transpose(0, 1).clone().requires_grad_(True)  # [b, s, V]
    dense = objective(dense_in, torch.where(loss_mask.bool(), labels, -100))
    dense.loss.backward()
    torch.testing.assert_close(result.output.loss, dense.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(local.grad, dense_in.grad.transpose(0, 1)[..., rank * v_local:(rank + 1) * v_local],
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="padded vocab"):
        language_model_loss(objective, labels, local[..., :-1], loss_mask, group=group)


def test_language_model_loss_on_shards():
    run_ranks(2, _check_language_model_loss_direct)
