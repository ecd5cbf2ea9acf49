"""recipes.training.diagnostics, the loop's side of the per-term gradient diagnostics: which steps compute
them, and a row finished from its sums; the sums of 2 data-parallel ranks x 2 micro-batches, added, summed
over the ranks (`recipes.training.parallel.reduce_sum`) and finished as the loop does, equal the dense
float64 reference on the global batch (tests/numloss/test_diagnostics.py, where the sums themselves are
checked)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from numloss import Objective, reduce_counts
from recipes.training.diagnostics import finish_row
from recipes.training.parallel import reduce_sum
from tests.distributed import run_ranks
from tests.numloss.test_diagnostics import CONFIGS, assert_matches, inputs, reference


def _data_parallel(rank, world):
    """2 ranks x 2 micro-batches of 2 rows: the loop's sums (micro-batches, then the SUM over ranks,
    then `finish_row`) against the reference on the whole global batch of 8 rows."""
    config = CONFIGS["mixed"]
    vocab, hidden, weight, labels = inputs("spread", rows=8)
    logits = hidden @ weight.t()
    want = reference(logits, labels, "spread", config)
    objective = Objective(vocab, config, diagnostics=True)
    window = [(logits[r:r + 2], labels[r:r + 2]) for r in (4 * rank, 4 * rank + 2)]
    step = reduce_counts([objective.counts(lab) for _, lab in window], group=dist.group.WORLD)
    sums: dict[str, float] = {}
    for mb_logits, mb_labels in window:
        for key, value in objective(mb_logits, mb_labels, counts=step).log_dict().items():
            sums[key] = sums.get(key, 0.0) + value
    row = finish_row({**reduce_sum(sums, torch.device("cpu"), dist.group.WORLD), "grad_norm": 2.5}, grad_clip=1.0)
    assert_matches(row, want, f"DP 2 rank {rank}")
    assert row["clipped"] == 1 and not any(k.startswith("grad_sums/") for k in row)


def test_data_parallel_micro_batches_match_the_global_batch():
    run_ranks(2, _data_parallel)


def test_which_steps_are_diagnosed_and_how_a_row_is_finished():
    from recipes.config import Recipe
    from recipes.training.diagnostics import diagnosed

    recipe = Recipe()
    recipe.train.steps, recipe.train.log_every = 9, 2
    steps = lambda: [s for s in range(1, 10) if diagnosed(recipe, s)]  # noqa: E731
    assert steps() == [2, 4, 6, 8, 9]  # default: every logged step, the last included
    recipe.train.grad_diagnostics_every = 4
    assert steps() == [4, 8, 9]
    recipe.train.grad_diagnostics_every = 3  # only logged steps: 6, and the last
    assert steps() == [6, 9]
    recipe.train.grad_diagnostics_every = 0
    assert steps() == []
    plain = {"step": 1, "loss": 2.0, "grad_norm": 3.0}
    assert finish_row(dict(plain), grad_clip=1.0) == plain  # no sums: no diagnostics keys, no `clipped`
    sums = {"grad_sums/ce/sq": 9.0, "grad_sums/ce/ref_sq": 9.0, "grad_sums/smmd/sq": 16.0, "grad_sums/smmd/dot_ce": -6.0}
    row = finish_row({**plain, **sums, "grad_norm": None}, grad_clip=1.0)
    assert row == {"step": 1, "loss": 2.0, "grad_norm": None, "clipped": None, "grad/ce/norm": 3.0,
                   "grad/ce/share": 3 / 7, "grad/smmd/norm": 4.0, "grad/smmd/share": 4 / 7, "grad/smmd/cos_ce": -0.5}
    assert finish_row({**plain, **sums, "grad_norm": 0.5}, grad_clip=1.0)["clipped"] == 0
    assert finish_row({**plain, **sums}, grad_clip=0.0)["clipped"] == 0  # no clipping configured
