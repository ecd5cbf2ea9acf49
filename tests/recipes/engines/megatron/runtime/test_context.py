"""Context parallelism on the Megatron engine (`megatron.cp_size`): refused before any model is built where
Transformer Engine cannot run (exit 2 from `recipes.train`, naming the key and Transformer Engine); the rank
layout (ParallelDims, megatron-core's groups on 4 gloo ranks: tp 1, cp 2, dp 2) and the step's counts,
each CP rank's load-balanced share summed over data x context parallel, equal to the whole global batch's."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
import torch.distributed as dist

from numloss import LossCounts, NumericVocab, Objective
from numloss.labels import shift_labels
from recipes.config import recipe_from_dict
from recipes.engines import engine_contract
from recipes.engines.megatron.pure.contract import context_parallel_problems
from tests.distributed import run_ranks

pytest.importorskip("megatron.core")


def _recipe(**megatron):
    return recipe_from_dict({"model": {"name_or_path": "x"}, "data": {"train": "d"},
                             "train": {"engine": "megatron", "seed": 3}, "megatron": megatron})


def test_cp_is_refused_without_transformer_engine():
    mg = _recipe(cp_size=2).megatron
    assert context_parallel_problems(_recipe().megatron, cuda=False) == []
    assert context_parallel_problems(mg, cuda=None) == []  # recipes.validate: the start is elsewhere
    [cpu] = context_parallel_problems(mg, cuda=False)
    assert cpu.startswith("megatron.cp_size: 2 needs Transformer Engine") and "CUDA is not available" in cpu
    [gpu] = context_parallel_problems(mg, cuda=True, te_missing=lambda: "transformer_engine.pytorch does not import")
    assert "transformer_engine.pytorch does not import" in gpu
    [built] = context_parallel_problems(mg, cuda=True, te_missing=lambda: None)
    assert "is not built in this version" in built


def test_recipes_train_refuses_cp_before_the_model(tmp_path):
    """`recipes.train.main` exits 2 naming megatron.cp_size and Transformer Engine, with no model built."""
    from tests.recipes.torchrun_helpers import tiny_workspace
    import recipes.train

    recipe = tiny_workspace(tmp_path, problems=16, max_digits=2, train={"steps": 1, "engine": "megatron"})
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as stop:
        recipes.train.main([str(recipe), f"train.out_dir={tmp_path / 'run'}", "megatron.cp_size=2"])
    assert stop.value.code == 2
    assert "megatron.cp_size: 2 needs Transformer Engine" in err.getvalue()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_layout_divides_the_world_by_cp():
    dims = engine_contract(_recipe(tp_size=2, cp_size=2)).parallel_dims(_recipe(tp_size=2, cp_size=2), 16)
    assert (dims.tp, dims.cp, dims.dp) == (2, 2, 4)
    problems = engine_contract(_recipe(cp_size=4)).layout_problems(_recipe(cp_size=4), None, 6)
    assert any("megatron.cp_size 4 x megatron.pp_size 1 does not divide the world of 6 ranks" in p for p in problems), problems


DIG = list(range(3, 13))


def _rows(dp_rank: int) -> list[torch.Tensor]:
    """Two micro-batches of two 8-position rows for data-parallel rank `dp_rank`: digit runs across the
    load-balanced chunks (positions 0-1 | 2-3 | 4-5 | 6-7 -> CP ranks 0, 1, 1, 0)."""
    g = torch.Generator().manual_seed(dp_rank)
    out = []
    for _ in range(2):
        labels = torch.randint(13, 20, (2, 8), generator=g)
        labels[0, 1:6] = torch.tensor(DIG[:5])
        labels[1, 0] = -100
        labels[1, 5:8] = torch.tensor(DIG[7:10])
        out.append(labels)
    return out


def _check_counts(rank, world):
    from megatron.core import parallel_state

    from recipes.engines.megatron.runtime.context import context_parallel_counts
    from recipes.engines.megatron.runtime.model import initialize_model_parallel

    initialize_model_parallel(_recipe(cp_size=2))
    try:
        cp_rank, dp_rank = parallel_state.get_context_parallel_rank(), parallel_state.get_data_parallel_rank()
        assert (cp_rank, dp_rank) == (rank % 2, rank // 2)  # tp-cp-dp-pp: CP next to TP
        assert dist.get_world_size(parallel_state.get_data_parallel_group(with_context_parallel=True)) == 4
        vocab = NumericVocab(DIG, [float(d) for d in range(10)], vocab_size=20)
        objective = Objective(vocab, {"terms": {"ntil": {}, "dist2": {"weighting": "place_value"}}})
        window = [{"labels": labels} for labels in _rows(dp_rank)]
        got = context_parallel_counts(objective, window)
        # the whole global batch: both data-parallel ranks' rows, whole, counted on one process
        want = LossCounts.total(objective.counts(shift_labels(labels)) for r in range(2) for labels in _rows(r))
        assert got.values == want.values, (got.values, want.values)
    finally:
        parallel_state.destroy_model_parallel()


def test_counts_over_data_and_context_parallel_ranks():
    run_ranks(4, _check_counts)
