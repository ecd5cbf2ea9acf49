"""The chunked head inside a 2-rank DeepSpeed ZeRO-3 job on CPU, through `NumericCausalLM`.

The ranks get different sequence lengths and numbers of valid tokens (rank 1's batch has none at all),
so they run different numbers of chunks; the job must finish, every parameter's full gradient must equal
the same job's on the logits path (Adam's first step only sees gradient signs, so gradients are compared,
not weights), and the SGD step must land on the same weights.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

from numloss import NumericVocab, Objective
from tests.distributed import run_ranks

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

V, HIDDEN = 67, 32
DIGITS = list(range(10, 20))
CONFIG = {"terms": {"smmd": {}, "gce": {"weight": 0.5}, "ntl_was": {}}}


def _batch(rank):
    g = torch.Generator().manual_seed(100 + rank)
    length = [24, 13][rank]  # different token counts: different numbers of chunks
    ids = torch.randint(V, (2, length), generator=g)
    ids[:, 5:8] = torch.tensor(DIGITS)[torch.randint(10, (2, 3), generator=g)]
    labels = ids.clone()
    labels[:, :4] = -100
    if rank == 1:
        labels[:] = -100  # no valid token on this rank
    return ids, labels


def _train_one_step(rank, chunked: bool):
    import deepspeed
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.integrations import HfDeepSpeedConfig

    from numloss.adapters.hf import NumericCausalLM

    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},  # partition every weight
        "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
        "zero_allow_untested_optimizer": True,  # plain SGD: the step is linear in the gradient
    }
    live = HfDeepSpeedConfig(ds_config)  # noqa: F841  (HF builds the model under zero.Init)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, attn_implementation="eager")
    model = AutoModelForCausalLM.from_config(config)
    vocab = NumericVocab(DIGITS, list(range(10)), vocab_size=V)
    wrapper = NumericCausalLM(model, Objective(vocab, CONFIG), chunked=chunked, chunk_size=5)
    engine, *_ = deepspeed.initialize(model=wrapper, model_parameters=wrapper.parameters(), config=ds_config)
    try:
        ids, labels = _batch(rank)
        from deepspeed.utils import safe_get_full_grad

        out = engine(input_ids=ids, labels=labels)
        engine.backward(out.loss)
        grads = {name: safe_get_full_grad(p).detach().clone() for name, p in engine.module.named_parameters()}
        engine.step()
        state = engine._zero3_consolidated_16bit_state_dict()
        return out.loss.detach(), grads, state
    finally:
        engine.destroy()


def _rank(rank, world):
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29521")
    import deepspeed.comm.torch  # noqa: F401

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # skip the inference-only shm op build
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    loss_chunked, grads_chunked, state_chunked = _train_one_step(rank, chunked=True)
    loss_logits, grads_logits, state_logits = _train_one_step(rank, chunked=False)
    torch.testing.assert_close(loss_chunked, loss_logits, rtol=1e-5, atol=1e-6)
    if rank == 1:
        assert loss_chunked.item() == 0.0  # no valid token: exactly 0, not NaN
    assert grads_chunked.keys() == grads_logits.keys()
    for name, grad in grads_logits.items():
        torch.testing.assert_close(grads_chunked[name], grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert grads_logits["model.lm_head.weight"].abs().max() > 1e-3  # the head did get a gradient
    if rank == 0:
        assert state_chunked.keys() == state_logits.keys()
        for name in state_logits:
            torch.testing.assert_close(state_chunked[name], state_logits[name], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{name}: {m}")
    dist.barrier()


def test_chunked_head_zero3_uneven_ranks_matches_logits_path():
    run_ranks(2, _rank)
