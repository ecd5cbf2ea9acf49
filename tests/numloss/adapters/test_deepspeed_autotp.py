"""DeepSpeed AutoTP (vocab-parallel lm_head) + ZeRO-3 at TP 2: the numeric objective on split logits
equals the TP-1 objective on the same weights. Real gloo processes, DeepSpeed on the CPU accelerator.

Each of 2 ranks (TP 2; every rank fed the same batch) builds a tiny random Llama under a
live HfDeepSpeedConfig, makes it compute the objective itself (`numloss.adapters.hf.numeric_autotp_model`,
what `recipes.train` gives DeepSpeed under AutoTP), initialises a DeepSpeed engine with
`"tensor_parallel": {"autotp_size": 2, "vocab_parallel_lm_head": true}` and ZeRO-3, and runs
`engine(ids, labels=labels)` on its logits shard (uneven vocab: 101 rows). Rank 0 consolidates the full
weights (`_zero3_consolidated_16bit_state_dict` gathers ZeRO and TP shards), runs a plain single-process
HF model on them and broadcasts the reference loss, terms and gradients; every rank checks its own
shard. Also checked: plain CE on the split logits against DeepSpeed's own `VocabParallelCausalLMLoss`.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch
import torch.distributed as dist

from numloss import NumericVocab, Objective
from tests.distributed import run_ranks

# deepspeed and transformers come with [train]; transformers' HfDeepSpeedConfig also needs accelerate.
# None of them is GPU-only, so a missing one fails here rather than skipping (and nothing heavy is
# imported into the pytest process: the ranks import them).
for _package in ("deepspeed", "transformers", "accelerate"):
    if importlib.util.find_spec(_package) is None:
        raise ImportError(f"tests/numloss/adapters/test_deepspeed_autotp.py needs {_package}")

V = 101  # odd: AutoTP splits it unevenly (51 + 50)
DIGIT_IDS = [3, 11, 24, 38, 47, 52, 60, 77, 85, 99]  # numeric tokens on both ranks' slices
DIGIT_VALUES = [5, 0, 9, 1, 4, 7, 2, 8, 6, 3]
CONFIG = {"terms": {"smmd": {}, "ntl_was": {}, "dist2": {}, "gce": {"weight": 0.5}}, "z_loss": 1e-4}


def _batch():
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(V, (2, 16), generator=g)
    digits = torch.tensor(DIGIT_IDS)
    ids[0, 4:7] = digits[torch.randint(10, (3,), generator=g)]  # a three-digit number
    ids[1, 9:11] = digits[torch.randint(10, (2,), generator=g)]
    ids[1, 15] = digits[0]  # a digit as the very last token: its label is shifted away
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt
    return ids, labels


def _ds_config(tp: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},  # no FusedAdam compile
        "tensor_parallel": {"autotp_size": tp, "vocab_parallel_lm_head": True},
    }


def _llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False, attn_implementation="eager")


def _no_shm_op():
    # DeepSpeed's CPU backend compiles a shared-memory comm op (inference only) at its first start;
    # `deepspeed.comm.torch.build_shm_op` returning None skips it (see docs/cluster.md).
    import deepspeed.comm.torch  # noqa: F401

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


def _autotp_rank(rank, world, tp):
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
    _no_shm_op()
    import deepspeed
    from deepspeed.utils import safe_get_full_grad
    from transformers import AutoModelForCausalLM, LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from numloss.adapters.deepspeed_autotp import causal_lm_objective, find_vocab_shard
    from numloss.adapters.hf import numeric_autotp_model

    deepspeed.init_distributed(dist_backend="gloo")
    ds_config = _ds_config(tp)
    live = HfDeepSpeedConfig(ds_config)  # noqa: F841  (must stay alive while the model is built)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_llama_config())
    vocab = NumericVocab(DIGIT_IDS, DIGIT_VALUES, vocab_size=V)
    objective = Objective(vocab, CONFIG)
    model = numeric_autotp_model(model, objective)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    try:
        shard = find_vocab_shard(engine)
        assert shard.group is not None and dist.get_world_size(shard.group) == tp
        assert (shard.start, shard.end, shard.vocab_size) == [(0, 51, V), (51, V, V)][dist.get_rank(shard.group)]

        ids, labels = _batch()
        with torch.no_grad():  # the HF model's own forward: logits of this rank's vocab shard
            logits = LlamaForCausalLM.forward(engine.module, input_ids=ids).logits
        assert logits.shape == (2, 16, shard.local_size)  # the logits stay split
        # CE against DeepSpeed's own VocabParallelCausalLMLoss (the hook AutoTP installed, left in place).
        assert type(engine.module.loss_function).__name__ == "VocabParallelCausalLMLoss"
        assert type(engine.module.lm_head).__name__ == "VocabParallelLinear"
        deepspeed_ce = engine.module.loss_function(logits=logits, labels=labels, vocab_size=V)
        plain_ce = causal_lm_objective(Objective(vocab, {"terms": {}}), logits, labels, shard)
        torch.testing.assert_close(plain_ce.loss, deepspeed_ce, rtol=1e-6, atol=1e-6)
        out = engine(input_ids=ids, labels=labels)
        direct = causal_lm_objective(objective, logits, labels, shard)
        torch.testing.assert_close(out.loss.detach(), direct.loss, rtol=0, atol=0)  # the forward is the objective
        engine.backward(out.loss)
        head = engine.module.lm_head
        lm_grad = safe_get_full_grad(head.weight).detach().clone()  # collective over the ZeRO group
        embed_grad = safe_get_full_grad(engine.module.model.embed_tokens.weight).detach().clone()
        assert lm_grad.shape == (shard.local_size, 32)

        state = engine._zero3_consolidated_16bit_state_dict()  # full weights on rank 0, None elsewhere
        reference = [None]
        if rank == 0:
            ref = LlamaForCausalLM(_llama_config())  # plain torch: no ZeRO, no TP
            ref.load_state_dict(state, strict=True)
            assert state["lm_head.weight"].shape == (V, 32)
            logits = ref(input_ids=ids).logits
            assert logits.shape == (2, 16, V)
            dense = causal_lm_objective(objective, logits, labels)
            dense.loss.backward()
            reference = [{"loss": dense.loss.detach(), "terms": {k: v.detach() for k, v in dense.terms.items()},
                          "ce": dense.ce.detach(), "numeric": dense.numeric_positions,
                          "lm_grad": ref.lm_head.weight.grad, "embed_grad": ref.model.embed_tokens.weight.grad}]
        dist.broadcast_object_list(reference, src=0)
        reference = reference[0]

        tol = dict(rtol=1e-5, atol=1e-5)
        where = f"rank {rank}"
        expected = int(torch.isin(labels[:, 1:], torch.tensor(DIGIT_IDS)).sum())  # the shift drops ids[:, 0]
        assert out.numeric_positions == reference["numeric"] == expected >= 5
        torch.testing.assert_close(out.loss.detach(), reference["loss"], **tol, msg=lambda m: f"{where} loss: {m}")
        torch.testing.assert_close(out.ce.detach(), reference["ce"], **tol)
        for name, value in reference["terms"].items():
            torch.testing.assert_close(out.terms[name].detach(), value, **tol,
                                       msg=lambda m: f"{where} {name}: {m}")
            assert value.abs() > 1e-3  # each term contributes something checkable
        torch.testing.assert_close(lm_grad, reference["lm_grad"][shard.start:shard.end], **tol,
                                   msg=lambda m: f"{where} lm_head grad: {m}")
        # The embedding is replicated across TP (not tied here): its gradient went through every layer.
        torch.testing.assert_close(embed_grad, reference["embed_grad"], **tol,
                                   msg=lambda m: f"{where} embed grad: {m}")
        engine.step()
    finally:
        engine.destroy()


def test_autotp_zero3_tp2_matches_tp1_reference():
    # 2 ranks: TP 2 (ZeRO-3 data parallel 1). `run_ranks(4, _autotp_rank, 2)` (TP 2 x ZeRO-3 DP 2, where
    # ZeRO really partitions the TP shards) passes as well but takes 65-80 s on 2 cores, so it is left out.
    run_ranks(2, _autotp_rank, 2)


def test_importing_numloss_and_its_adapters_imports_no_framework():
    import subprocess

    code = ("import sys, numloss, numloss.adapters.deepspeed_autotp, numloss.adapters.hf, numloss.adapters.megatron;"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('deepspeed', 'megatron', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_model_computes_the_objective_on_a_plain_hf_model():
    # TP 1, no DeepSpeed: find_vocab_shard gives full logits; the model's forward is the objective on its
    # own logits, and its class and module names stay the HF model's (what AutoTP reads).
    from transformers import LlamaForCausalLM

    from numloss.adapters.deepspeed_autotp import causal_lm_objective, find_vocab_shard
    from numloss.adapters.hf import numeric_autotp_model

    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config())
    shard = find_vocab_shard(model)
    assert (shard.group, shard.start, shard.end, shard.vocab_size) == (None, 0, V, V)
    objective = Objective(NumericVocab(DIGIT_IDS, DIGIT_VALUES, vocab_size=V), CONFIG)
    names = [name for name, _ in model.named_parameters()]
    numeric = numeric_autotp_model(model, objective)
    assert numeric is model and isinstance(model, LlamaForCausalLM) and type(model).__name__ == "NumericLlamaForCausalLM"
    assert [name for name, _ in model.named_parameters()] == names and "lm_head.weight" in names
    ids, labels = _batch()
    out = model(input_ids=ids, labels=labels)
    logits = LlamaForCausalLM.forward(model, input_ids=ids).logits
    direct = causal_lm_objective(objective, logits, labels)
    torch.testing.assert_close(out.loss, direct.loss, rtol=0, atol=0)
    assert out.numeric_positions > 0 and (direct.loss - direct.ce).abs() > 1e-3
    with pytest.raises(ValueError, match="exactly one"):
        causal_lm_objective(objective, logits, labels, shifted_labels=labels)


def test_step_counts_add_the_micro_batches_up_to_the_whole_batch():
    """`loss_counts` (the step's every denominator): the two rows as two micro-batches add up to the
    objective on both rows at once, numeric terms included."""
    from transformers import LlamaForCausalLM

    from numloss import LossCounts, shift_labels
    from numloss.adapters.deepspeed_autotp import causal_lm_objective
    from numloss.adapters.hf import numeric_autotp_model

    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config())
    objective = Objective(NumericVocab(DIGIT_IDS, DIGIT_VALUES, vocab_size=V), CONFIG)
    numeric_autotp_model(model, objective)
    ids, labels = _batch()
    whole = causal_lm_objective(objective, LlamaForCausalLM.forward(model, input_ids=ids).logits, labels)
    step = LossCounts.total(objective.counts(shift_labels(labels[i:i + 1])) for i in range(2))
    assert step == LossCounts.total(model.counts(labels[i:i + 1]) for i in range(2))  # the model's own counts
    parts = [model(input_ids=ids[i:i + 1], labels=labels[i:i + 1], loss_counts=step).loss for i in range(2)]
    torch.testing.assert_close(parts[0] + parts[1], whole.loss, rtol=1e-6, atol=1e-6)
    own = [model(input_ids=ids[i:i + 1], labels=labels[i:i + 1]).loss for i in range(2)]  # each row's own counts
    assert abs(float((own[0] + own[1] - whole.loss).detach())) > 1e-4
