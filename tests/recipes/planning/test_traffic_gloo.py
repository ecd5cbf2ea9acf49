"""The DeepSpeed plan's traffic (recipes.engines.deepspeed.pure.costs.zero_collectives) against the bytes a real ZeRO-3
run moves: DeepSpeed 0.19.8 on gloo ranks, a tiny Llama, the torch.distributed collectives wrapped to
count each call's payload by collective and group size over the second optimizer step.

Settings that make a tiny model behave as a 70B one does: `stage3_param_persistence_threshold` 0 (at 70B
the persistent parameters, norms, are 0.0002 % of the bytes; at this size they would be 6 %) and
`stage3_max_reuse_distance` 0 (at 70B the default 1e9 elements keeps about one layer gathered between the
forward and the backward; at this size it would keep the whole model), and no prefetching
(`stage3_prefetch_bucket_size` 0). With prefetching on, DeepSpeed gathered fewer bytes inside the node
than the plan counts on this model (seen here: 2.08 of the 3 in-node gathers per step with a bucket of 1
element, 1.46 with one of h x I), so the plan's in-node gather bytes are an upper bound; how much
prefetching saves at 70B was not measured (docs/cluster.md lists it among the first GPU checks).
"""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path

import pytest

from recipes.engines.deepspeed.pure import costs
from tests.distributed import run_ranks

OPS = {"all_gather_into_tensor": "all_gather", "_all_gather_base": "all_gather",
       "reduce_scatter_tensor": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter", "all_reduce": "all_reduce"}


def _count(rank: int, world: int, out: str, hpz: int, accum: int, bf16: bool) -> None:
    """One rank: count every collective's payload (the whole gathered / reduced buffer) during step 2."""
    import torch
    import torch.distributed as dist

    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank))
    import deepspeed

    from recipes.engines.deepspeed.runtime.distributed import skip_cpu_shm_op

    skip_cpu_shm_op()
    counts: collections.Counter = collections.Counter()
    on = [False]

    def wrap(kind, fn):
        def counted(*args, **kwargs):
            if on[0]:
                n = dist.get_world_size(kwargs.get("group"))
                sizes = [t.numel() * t.element_size() for t in [*args, *kwargs.values()] if torch.is_tensor(t)]
                counts[f"{kind}/{n}"] += max(sizes)
            return fn(*args, **kwargs)
        return counted

    for name, kind in OPS.items():  # before DeepSpeed's backend binds them
        if hasattr(dist, name):
            setattr(dist, name, wrap(kind, getattr(dist, name)))
    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 0,
            "overlap_comm": False, "contiguous_gradients": True, "reduce_bucket_size": 64 * 64}
    if hpz > 1:
        zero["zero_hpz_partition_size"] = hpz
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": accum, "train_batch_size": accum * world,
          "zero_optimization": zero, "steps_per_print": 10**9}
    if bf16:
        ds.update(bf16={"enabled": True}, communication_data_type="bf16")
    with deepspeed.zero.Init(config_dict_or_path=ds):
        model = LlamaForCausalLM(cfg)
    if bf16:
        model = model.to(torch.bfloat16)
    params = sum(p.ds_numel for p in model.parameters())
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), config=ds)
    x = torch.randint(0, 256, (1, 16))
    for step in range(2):
        on[0] = step == 1
        for _ in range(accum):
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
    on[0] = False
    Path(out, f"rank{rank}.json").write_text(json.dumps({"params": params, "counts": dict(counts)}))
    engine.destroy()


def _counted(tmp_path, world, hpz, accum, bf16=False) -> tuple[int, dict]:
    run_ranks(world, _count, str(tmp_path), hpz, accum, bf16)
    got = json.loads((tmp_path / "rank0.json").read_text())
    return got["params"], got["counts"]


def _ring(payload: float, n: int) -> float:
    return payload * (n - 1) / n


@pytest.mark.timeout(600)
def test_hpz_gathers_once_per_step_across_nodes_and_reduce_scatters_every_micro_batch(tmp_path):
    """4 ranks as 2 "nodes" of 2, hpZ 2, 2 micro-batches per step, fp32: the plan says one gather over all 4
    ranks per step, 2G - 1 = 3 inside the node, and G = 2 reduce-scatters over all 4."""
    params, counts = _counted(tmp_path, world=4, hpz=2, accum=2)
    plan = {c.name: c for c in costs.zero_collectives(params, zero_stage=3, tp=1, dp=4, ranks_per_node=2, hpz=2,
                                                   grad_accum=2, e=4, reduce_bytes=4)}
    assert plan["parameter all-gather (the step's first forward)"].ring == pytest.approx(
        _ring(counts["all_gather/4"], 4), rel=0.01)
    hpz = plan["parameter all-gathers (hpZ, inside the node)"]
    assert hpz.ring == pytest.approx(_ring(counts["all_gather/2"], 2), rel=0.01) and hpz.net == 0
    assert plan["gradient reduce-scatter"].ring == pytest.approx(_ring(counts["reduce_scatter/4"], 4), rel=0.01)
    assert plan["gradient reduce-scatter"].net == pytest.approx(plan["gradient reduce-scatter"].ring / 2)
    # nothing else of that size moved: the remaining collectives are the step's scalars
    assert counts.get("all_reduce/4", 0) < 0.01 * params


@pytest.mark.timeout(600)
def test_without_hpz_every_micro_batch_gathers_twice_and_bf16_reduction_halves_the_gradient(tmp_path):
    """2 ranks, no hpZ, 2 micro-batches, bf16 weights and communication_data_type bf16."""
    params, counts = _counted(tmp_path, world=2, hpz=1, accum=2, bf16=True)
    plan = {c.name: c for c in costs.zero_collectives(params, zero_stage=3, tp=1, dp=2, ranks_per_node=2, hpz=1,
                                                   grad_accum=2, e=2, reduce_bytes=2)}
    assert plan["parameter all-gathers (forward and backward)"].calls == 4
    assert plan["parameter all-gathers (forward and backward)"].ring == pytest.approx(
        _ring(counts["all_gather/2"], 2), rel=0.01)
    assert plan["gradient reduce-scatter"].ring == pytest.approx(_ring(counts["reduce_scatter/2"], 2), rel=0.01)
