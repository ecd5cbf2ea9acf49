"""recipes.parallel_dims.ParallelDims: the one data-parallel size, the degrees checked when it is made, and
the layout problems named by the engine's keys."""

from __future__ import annotations

import itertools

import pytest

from recipes.parallel_dims import ParallelDims


@pytest.mark.parametrize("world, tp, pp", list(itertools.product([1, 6, 8, 64], [1, 2, 4, 8], [1, 2, 4])))
def test_the_data_parallel_size_is_the_ranks_left_over_by_tp_and_pp(world, tp, pp):
    dims = ParallelDims.of(world, tp=tp, pp=pp)
    replicas = [r for r in range(1, world + 1) if r * tp * pp == world]  # the count, found by search
    assert dims.divides == bool(replicas)
    assert dims.dp == (replicas[0] if replicas else max(1, world // (tp * pp)))
    assert dims.global_batch(micro_batch_size=2, grad_accum=3) == 6 * dims.dp


def test_sequence_parallelism_only_with_tensor_parallelism_and_no_interleaving_is_one_chunk():
    assert not ParallelDims.of(8, tp=1, sp=True).sp and ParallelDims.of(8, tp=2, sp=True).sp
    assert ParallelDims.of(8, pp=2, vpp=None).vpp == 1


def test_problems_name_the_engines_keys():
    assert ParallelDims.of(3, tp=2).problems({"tp": "deepspeed.tp_size"}) == [
        "deepspeed.tp_size: 2 does not divide the world of 3 ranks"]
    assert ParallelDims.of(3, tp=2).problems({"tp": "megatron.tp_size", "pp": "megatron.pp_size"}) == [
        "megatron.tp_size x megatron.pp_size: 2 x 1 does not divide the world of 3 ranks (data-parallel size = "
        "world / (tp x pp))"]
    moe = ParallelDims.of(8, tp=2, ep=3)  # dp 4
    assert moe.edp == 1 and moe.problems({"tp": "megatron.tp_size", "ep": "megatron.ep_size"}) == [
        "megatron.ep_size: 3 does not divide the data-parallel size 4 (world 8 / (tp 2 x pp 1)): expert parallelism "
        "splits data-parallel ranks"]
    assert ParallelDims.of(16, tp=2, ep=4).edp == 2
    with pytest.raises(ValueError, match="does not divide the world of 3 ranks"):
        ParallelDims.of(3, tp=2).check({"tp": "deepspeed.tp_size"})


@pytest.mark.parametrize("kwargs", [{"world": 0}, {"world": 8, "tp": 0}, {"world": 8, "pp": -1}, {"world": 8, "ep": 1.5},
                                    {"world": 8, "tp": True}, {"world": 8, "tp": 2, "dp": 2}])
def test_bad_degrees_are_refused_when_made(kwargs):
    with pytest.raises(ValueError, match="ParallelDims"):
        ParallelDims(**kwargs)


def test_rows_split_over_cp_ranks_take_a_factor_of_the_world():
    """cp: the ranks that split each row's positions (DeepSpeed's sp_size, Megatron's cp_size) read the same
    rows, so the data-parallel size is world / (tp x cp x pp); a cp that does not divide is named by its key."""
    dims = ParallelDims.of(16, tp=2, cp=4)
    assert (dims.dp, dims.replica, dims.global_batch(2, 3)) == (2, 8, 12)
    assert ParallelDims.of(8, cp=2, pp=2).dp == 2
    [problem] = ParallelDims.of(6, cp=4).problems({"tp": "deepspeed.tp_size", "cp": "deepspeed.sp_size"})
    assert problem.startswith("deepspeed.tp_size 1 x deepspeed.sp_size 4 does not divide the world of 6 ranks")
    with pytest.raises(ValueError, match="ParallelDims.cp"):
        ParallelDims.of(4, cp=0)
