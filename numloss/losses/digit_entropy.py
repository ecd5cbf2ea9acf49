"""DEL, the Digit Entropy Loss (arXiv 2605.20369): place-weighted one-vs-rest entropy of the ten digits.

Needs the ten digit tokens 0..9 (one numeric column each) and the decimal point's token id. At each
position whose label is a digit, with `l` the ten digit logits (not renormalised over the vocabulary) and
`p = softmax(l)` over the ten (not detached):

    w · Σ_j BCE(l_j, 1[j = y]) · p_j        (BCE: binary cross-entropy with logits, one-vs-rest)

`w`, the place weight. A number is a maximal run of digit and decimal-point labels within a sequence (an
ignored label, any other label and the row's end stop it). An integer digit k places left of the run's
first decimal point (or of the run's end; the units digit has k = 1) weighs 2k; the digit d places after
the first decimal point weighs 1.02^-(d+1). A run whose first token is the point counts as an integer,
all of it; a point after the last digit (a sentence's period) changes no weight. "123" -> 6, 4, 2;
"12.55" -> 4, 2, 1.02^-2, 1.02^-3; ".4.5" -> 6, 2. Places count tokens, so any point but the first
takes a place like a digit ("1.2.3" -> 2, 1.02^-2, 1.02^-4), as in the authors' code.

Value: the sum over digit positions / (10 x their count) (the count is the step's with `denominator`);
the authors add 0.01 x it to the cross-entropy. Their code groups runs over the flattened valid
positions of the whole batch, so a run can cross an ignored label or a row's end; here runs stay in a
row and stop at an ignored label, and the two agree wherever theirs does not cross. The weights are
computed exactly (their code goes through float32 logarithms).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..logit_stats import LogitStats
from ..runs import numeric_runs
from ..vocab import NumericVocab
from .common import mean_or_zero

INTEGER_STEP = 2.0  # an integer digit k places left of the point weighs 2k
FRACTION_BASE = 1.02  # the d-th digit after the point weighs 1.02^-(d+1)
DIGITS = 10


def digit_places(stats: LogitStats, decimal_point_id: int | None) -> torch.Tensor:
    """[M] fp32 place weight of each numeric (digit) position, in the order of `stats.numeric.rows`. Under
    a sequence split (`stats.split`) the weights come from the whole rows' runs."""
    view = stats.split
    if view is None:
        return _places(stats.labels, stats.valid, stats.is_numeric, stats.shape, decimal_point_id)
    whole = _places(view.labels, view.valid, view.is_numeric, view.shape, decimal_point_id)
    return whole[view.whole_numeric(stats.numeric.rows)].to(stats.valid.device)


def _places(labels: torch.Tensor, valid: torch.Tensor, is_digit: torch.Tensor, shape: torch.Size,
            decimal_point_id: int | None) -> torch.Tensor:
    """[M] fp32 place weight of each digit position of flat `labels` (shaped `shape`), in flat order."""
    device = valid.device
    member = is_digit
    if decimal_point_id is not None:
        member = member | (valid & (labels == decimal_point_id))
    runs = numeric_runs(member.view(shape))
    positions = member.nonzero().flatten()  # [P] flat, increasing: the runs' members
    if positions.numel() == 0:
        return torch.zeros(0, dtype=torch.float32, device=device)
    last = positions + runs.after  # each member's run's last position
    first = torch.zeros(runs.num_runs, dtype=torch.long, device=device).scatter_reduce_(
        0, runs.run_id, positions, reduce="amin", include_self=False)[runs.run_id]
    # the anchor: the run's first decimal point, unless it opens the run (then the whole run is an
    # integer, later points included); else one past the run's end
    point = ~is_digit[positions]
    first_point = torch.zeros(runs.num_runs, dtype=torch.long, device=device).scatter_reduce_(
        0, runs.run_id, torch.where(point, positions, last + 1), reduce="amin", include_self=False)[runs.run_id]
    anchor = torch.where(first_point == first, last + 1, first_point)
    digits = ~point
    offset = (anchor - positions)[digits].double()  # > 0: k places left; < 0: -d places right
    weights = torch.where(offset > 0, INTEGER_STEP * offset, FRACTION_BASE ** (offset - 1))
    return weights.to(torch.float32)


def digit_entropy_term(
    stats: LogitStats,
    vocab: NumericVocab,
    decimal_point_id: int | None = None,
    denominator: float | None = None,
) -> torch.Tensor:
    """DEL without its 0.01 weight. `decimal_point_id`: the "." token (None: the vocabulary's, which
    `NumericVocab.from_tokenizer` finds). `denominator`: the step's digit positions (`numloss.normalization`
    "numeric"); default this batch's."""
    if not vocab.is_ten_digits():
        raise ValueError(f"del needs exactly the ten digit tokens 0..9; {vocab!r} is not that")
    if decimal_point_id is None:
        decimal_point_id = vocab.decimal_point_id
    num = stats.numeric
    logits = num.logits  # [M, 10] fp32; the columns' order does not matter: the target is a column
    targets = F.one_hot(num.target, DIGITS).to(logits.dtype)
    entropy = F.binary_cross_entropy_with_logits(logits, targets, reduction="none")
    per_position = (entropy * torch.softmax(logits, dim=-1)).sum(dim=-1)
    weights = digit_places(stats, decimal_point_id)
    if denominator is None:
        denominator = float(num.count)
    return mean_or_zero(per_position * weights, denominator=DIGITS * denominator)
