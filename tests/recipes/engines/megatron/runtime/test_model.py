"""The converted GPTModel against the HF model, on 2 real gloo processes (one spawn, every layout in it):

- logits equal HF's (fp32, 1e-5) at TP 1 (DP 2) and TP 2, for a tied Llama (Llama-3 RoPE scaling, GQA)
  and an untied Qwen2 with QKV bias; at TP 2 with sequence parallelism; at PP 2 through megatron's 1F1B
  schedule and at PP 2 x VP 2 through the interleaved one (forward only); the padded vocabulary
  columns are exactly 0 (zero rows);
- one training step under megatron's DDP with `finalize_model_grads` gives HF's loss and every
  gradient: at TP 2 + SP (the RMSNorm weights' gradients are summed over the sequence slices) and at
  PP 2 x VP 2 through interleaved 1F1B (the tied embedding's gradient all-reduced between the first
  and last stage); then a `dist_checkpointing` save and load into a
  zeroed model gives back the same weights;
- a random-init model (`model.config`) at TP 2 in bf16 with selective recompute builds and trains.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.recipes.engines.megatron.helpers import VOCAB, recipe_for, run_ranks, save_tiny

if importlib.util.find_spec("megatron.core") is None:
    raise ImportError("tests/recipes/engines/megatron needs megatron-core (pip install -e '.[megatron]')")

B, S = 4, 24  # B micro-batches of one sequence each in the pipeline schedules
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _batch():
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, VOCAB, (B, S), generator=g), torch.randint(0, VOCAB, (B, S), generator=g)


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()


def _build(recipe):
    """This rank's chunks, after setting up megatron's groups for the recipe."""
    from recipes.engines.megatron.runtime.model import (
        build_model_chunks,
        initialize_model_parallel,
    )

    initialize_model_parallel(recipe)
    return build_model_chunks(recipe)


def _gather_vocab(local: torch.Tensor) -> torch.Tensor:
    """[..., V'/tp] on every TP rank -> [..., V'] (test-side gather)."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _schedule_logits(chunks, ids, forward_only=True, labels=None):
    """Run megatron's pipeline schedule with one sequence per micro-batch; returns (logits [B, S, V']
    on the last stage or None, losses). The loss is the mean CE over the real (unpadded) vocabulary."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.mappings import (
        gather_from_tensor_model_parallel_region,
    )

    pos = torch.arange(S)[None]
    logits_out: list = []

    def forward_step(data_iterator, model):
        i = next(data_iterator)
        out = model(ids[i:i + 1], pos, None)

        def loss_func(output):
            logits_out.append(output.detach())
            if labels is None:
                return output.sum() * 0, {}
            if parallel_state.get_tensor_model_parallel_world_size() > 1:  # differentiable gather (split back)
                output = gather_from_tensor_model_parallel_region(output)
            loss = F.cross_entropy(output[..., :VOCAB].reshape(-1, VOCAB), labels[i:i + 1].reshape(-1))
            return loss, {"loss": loss.detach().clone()}  # megatron divides `loss` in place afterwards

        return out, loss_func

    iters = [iter(range(B)) for _ in chunks]
    result = get_forward_backward_func()(forward_step_func=forward_step,
                                         data_iterator=iters if len(chunks) > 1 else iters[0],
                                         model=chunks, num_microbatches=B, seq_length=S, micro_batch_size=1,
                                         forward_only=forward_only)
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None, result
    return torch.cat(logits_out), result


def _check_logits(recipe, reference, where):
    from megatron.core import parallel_state

    from recipes.engines.megatron.runtime.convert import tp_split_dim

    chunks = _build(recipe)
    for chunk in chunks:  # what megatron's grad norms read: split parameters are marked as such
        for name, p in chunk.named_parameters():
            dim = tp_split_dim(name)
            assert getattr(p, "tensor_model_parallel", False) == (dim is not None), (where, name)
            assert dim is None or p.partition_dim == dim, (where, name)
    ids, _ = _batch()
    with torch.no_grad():
        if len(chunks) == 1 and recipe.megatron.pp_size == 1:
            local = chunks[0](ids, torch.arange(S)[None].expand(B, S), None)
        else:
            local, _ = _schedule_logits(chunks, ids)
    if local is not None:
        assert local.shape[:2] == (B, S), where
        full = _gather_vocab(local)
        tp = recipe.megatron.tp_size
        assert full.shape[-1] == 128 * tp * -(-VOCAB // (128 * tp)), where
        torch.testing.assert_close(full[..., :VOCAB], reference, **TOL, msg=lambda m: f"{where}: {m}")
        assert (full[..., VOCAB:] == 0).all(), where
    parallel_state.destroy_model_parallel()


def _train_step(recipe, hf_model):
    """One step of `recipe`'s layout under megatron's DDP (megatron's schedule, `finalize_model_grads`):
    the loss and every gradient equal HF's. Returns this rank's chunks."""
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    from recipes.engines.megatron.runtime.convert import hf_to_megatron

    chunks = _build(recipe)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    ddp = [DistributedDataParallel(c.config, ddp_config, c, disable_bucketing=i > 0) for i, c in enumerate(chunks)]
    config = chunks[0].config
    config.no_sync_func = [m.no_sync for m in ddp] if len(ddp) > 1 else ddp[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    for m in ddp:
        m.zero_grad_buffer()
    ids, labels = _batch()
    _, losses = _schedule_logits(ddp, ids, forward_only=False, labels=labels)

    hf_model.zero_grad()
    ref_loss = F.cross_entropy(hf_model(ids).logits.reshape(-1, VOCAB), labels.reshape(-1))
    ref_loss.backward()
    tp_rank, pp_rank = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    tp, pp = recipe.megatron.tp_size, recipe.megatron.pp_size
    if pp_rank == pp - 1:
        torch.testing.assert_close(torch.stack([r["loss"] for r in losses]).mean(), ref_loss.detach(), **TOL)
    hf_grads = {n: p.grad for n, p in hf_model.named_parameters()}
    hf_grads.setdefault("lm_head.weight", hf_grads["model.embed_tokens.weight"])
    for chunk in chunks:
        expected = hf_to_megatron(hf_grads.__getitem__, config, hf_model.config, tp_rank=tp_rank, tp_size=tp,
                                  pp_rank=pp_rank, pp_size=pp, vp_stage=chunk.vp_stage)
        got = {n: p.main_grad for n, p in chunk.named_parameters()}
        assert sorted(got) == sorted(expected), (pp_rank, chunk.vp_stage)
        for name, grad in expected.items():
            # tied: both copies hold the sum of both uses; SP: norms hold the sum over the sequence slices
            where = f"{recipe.megatron} grad {name} (TP rank {tp_rank}, PP rank {pp_rank}, chunk {chunk.vp_stage})"
            torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=lambda msg, w=where: f"{w}: {msg}")
    return chunks


def _train_step_and_checkpoint(llama_dir, ckpt_dir, hf_model):
    """PP 2 x VP 2 (one layer per chunk): a training step, then a dist_checkpointing round trip."""
    from megatron.core import dist_checkpointing, parallel_state

    chunks = _train_step(recipe_for(llama_dir, pp=2, vp=2), hf_model)

    # dist_checkpointing: save, zero the weights, load back
    state = {f"model{v}": c.sharded_state_dict() for v, c in enumerate(chunks)}
    dist_checkpointing.save(state, str(ckpt_dir))
    before = [{n: p.detach().clone() for n, p in c.named_parameters()} for c in chunks]
    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                p.zero_()
    loaded = dist_checkpointing.load({f"model{v}": c.sharded_state_dict() for v, c in enumerate(chunks)},
                                     str(ckpt_dir))
    for v, c in enumerate(chunks):
        c.load_state_dict(loaded[f"model{v}"])
        for n, p in c.named_parameters():
            assert torch.equal(p, before[v][n]), (v, n)
    parallel_state.destroy_model_parallel()


def _random_init_bf16(rank):
    """`model.config` (random init) at TP 2 in bf16 with selective recompute: builds, replicated weights
    agree across TP ranks, forward and backward run with finite gradients."""
    from megatron.core import parallel_state

    from recipes.sections import ModelConfig
    from tests.recipes.engines.megatron.helpers import LLAMA

    recipe = recipe_for("unused", tp=2)
    recipe.model = ModelConfig(config={"model_type": "llama", **LLAMA}, tokenizer="unused", dtype="bfloat16")
    recipe.megatron.recompute = "selective"
    (model,) = _build(recipe)
    assert model.config.recompute_granularity == "selective"
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    norm = model.decoder.layers[0].input_layernorm.weight
    with torch.no_grad():
        norm.add_(torch.arange(norm.numel()) * 1e-2)  # not all ones: the comparison below means something
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(norm) for _ in range(2)]
    dist.all_gather(parts, norm.detach(), group=group)
    assert torch.equal(parts[0], parts[1])
    qkv = model.decoder.layers[0].self_attention.linear_qkv.weight.detach()
    dist.all_gather(parts := [torch.empty_like(qkv) for _ in range(2)], qkv, group=group)
    assert not torch.equal(parts[0], parts[1])  # different shards of one initialised weight
    ids, _ = _batch()
    logits = model(ids, torch.arange(S)[None].expand(B, S), None)
    assert logits.shape == (B, S, 256) and logits.dtype == torch.bfloat16
    logits.float().square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    parallel_state.destroy_model_parallel()


def _two_ranks(rank, world, llama_dir, qwen_dir, ckpt_dir):
    from recipes.engines.megatron.runtime import cpu_shim

    assert cpu_shim.apply() and cpu_shim.apply()  # idempotent
    ids, _ = _batch()
    llama = _hf(llama_dir)
    with torch.no_grad():
        ref = {"llama": llama(ids).logits, "qwen2": _hf(qwen_dir)(ids).logits}
    dirs = {"llama": llama_dir, "qwen2": qwen_dir}
    layouts = [("llama", {"tp": 1}), ("qwen2", {"tp": 1}), ("llama", {"tp": 2}), ("qwen2", {"tp": 2}),
               ("llama", {"tp": 2, "sp": True}), ("qwen2", {"tp": 2, "sp": True}), ("llama", {"pp": 2}),
               ("qwen2", {"pp": 2}), ("llama", {"pp": 2, "vp": 2})]
    for kind, layout in layouts:
        _check_logits(recipe_for(dirs[kind], **layout), ref[kind], f"rank {rank} {kind} {layout}")
    _train_step(recipe_for(llama_dir, tp=2, sp=True), llama)
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    _train_step_and_checkpoint(llama_dir, ckpt_dir, llama)
    _random_init_bf16(rank)


def test_two_ranks_logits_training_step_and_checkpoint(tmp_path):
    llama = save_tiny("llama", tmp_path / "llama")
    qwen = save_tiny("qwen2", tmp_path / "qwen2")
    (tmp_path / "ckpt").mkdir()  # dist_checkpointing.save wants an existing directory
    run_ranks(2, _two_ranks, llama, qwen, tmp_path / "ckpt", timeout=420)
