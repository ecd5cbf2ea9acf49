"""Per-term gradient diagnostics: how much of the update each part of the objective drives.

The objective's total is a sum of parts (`Objective.parts`): "ce" (CE, or (1 - w)·CE beside GCE), each
configured term's w·term ("gce" is w·GCE) and "z_loss" when configured. The diagnostic gradient of a
part is its gradient with respect to the logits, d(part)/d(logits), restricted to the NUMERIC BLOCK:
the M numeric positions x the N numeric columns, an [M, N] matrix. Per part the diagnostics report

- `grad/<part>/norm`: the Frobenius norm of that block over the whole global batch;
- `grad/<part>/share`: its norm / the sum of every part's norm (CE's included): in [0, 1], the shares
  add up to 1 whatever the angles between the parts. (The alternative, each part's projection on the
  total gradient over the total's squared norm, also adds up to 1 but goes negative when a part pulls
  against the others; the direction is what `cos_ce` says, so the share stays a pure magnitude.)
- `grad/<part>/cos_ce` (every part but CE): the cosine between its block and CE's. CE's direction is
  the gradient of CE itself (weight 1), so the cosine is defined when GCE at weight 1 leaves CE no part
  of the total (and keeps CE's sign when 1 - w < 0). None (JSON null) where a norm is 0.
- `grad/<part>/off_block_max`: an upper bound on the norm of the part's gradient on the V - N other
  columns of the numeric rows, the piece the block leaves out (below). 0 for the terms renormalised
  over the numeric tokens; for CE, GCE, z-loss, DIST2 paper mode and NTL `reweigh`, small against
  `norm` once the model puts its mass at a numeric position on the numeric tokens.

What the block holds, and what it leaves out:
- The terms that read only the numeric logits at the numeric positions (SMMD, NTL-WAS/MSE, NTIL, DEL,
  DIST2 `normalize="numeric"`; a registered term without the need "full_vocab"): the block is their
  whole gradient.
- CE, z-loss and the full-vocabulary terms (GCE, DIST2 paper mode, NTL `reweigh`) also depend on the
  log-sum-exp, whose gradient is the softmax at every column: the block holds its numeric columns (at
  a numeric row i and column j, ∂/∂x_ij + ∂/∂lse_i · p_ij, p the full-vocabulary softmax). Left out:
  their gradient on the V - N other columns of the numeric rows, and CE's, GCE's and z-loss's at the
  non-numeric positions. So CE's norm is that of its gradient on the numbers, where the terms compete
  with it, not of its whole gradient. On the other columns of a numeric row i no part reads a logit
  itself, so there the gradient is ∂/∂lse_i · p_ij: its squared norm is (∂/∂lse_i)² Σ_j p_ij², at most
  (∂/∂lse_i · m_i)² with m_i = 1 - Σ_numeric p_ij, the softmax mass off the numeric tokens (equal when
  that mass sits on one token). The block gives m_i, so the bound costs no pass over the vocabulary and
  no collective; the exact value would need Σ_j p_ij² over every column (one more pass and, under TP,
  an all-reduce).

How: the parts are evaluated again on detached copies of the [M, N] numeric logits and the [M]
log-sum-exp at those rows (and of the [T] per-token statistics, for CE and GCE), and
`torch.autograd.grad` of each part gives (∂/∂numeric logits, ∂/∂lse); the block is the first plus
the second times exp(numeric logits - lse). The training graph is not touched: turning diagnostics on
changes neither the loss nor any gradient, to the bit. The diagnostics run before the training terms
and restore every random generator they may draw from (torch's, on the logits' device, and a term's
`generator` option), so NTIL's Gumbel noise is drawn for the training as without them, and the
diagnostics see that same noise. Cost: one more evaluation of the parts' [M, N] math and one small
backward per part, on logged steps only (`recipes.train`: `train.grad_diagnostics_every`).

Parallel contract: under TP every rank holds the same [M, N] block and log-sum-exp (`LogitStats`), so
every rank computes the same sums with no collective; the chunked head's stats are the same. For an
objective without numeric terms (plain CE) the single pass skips the numeric columns; there the
diagnostics read them themselves (`with_numeric_block`: one extra collective under TP, on diagnostic
steps only), so that a CE-only run reports CE's norm on the numbers as a baseline.

Several micro-batches and data-parallel ranks: with the step's counts (`numloss.normalization`) a
micro-batch's part is its share of the global batch's, so the global batch's block is the micro-batches'
blocks side by side. A micro-batch returns additive sums: `grad_sums/<part>/sq` (squared norm),
`grad_sums/<part>/dot_ce` (dot product with CE's direction), `grad_sums/<part>/off_sq_max` (the bound's
square) and `grad_sums/ce/ref_sq` (CE's direction's squared norm). SUM them over micro-batches and
data-parallel ranks (never over TP ranks, which hold the same rows), then `finalize` gives the global
batch's norms, shares, cosines and bounds. Only `rescale_to_ce` (a ratio of one micro-batch's own
values) and NTIL's noise make them depend on the split, as the loss.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator, Mapping

import torch

from .logit_stats import LogitStats, NumericRows, plan_labels
from .parallel import exchange_numeric_columns

PREFIX = "grad_sums/"
REFERENCE = "ce"  # the part whose direction the cosines are taken against


def part_names(objective) -> list[str]:
    """The names of `objective`'s parts (`Objective.parts`): ce, every term, z_loss when configured."""
    return ["ce", *objective.config.terms, *(["z_loss"] if objective.config.z_loss else [])]


def sum_keys(objective) -> list[str]:
    """The keys of `gradient_sums`'s result for `objective`, sorted: known on every rank and pipeline
    stage before any logit is (`recipes.engines.megatron.runtime.step` broadcasts the values in this order)."""
    keys = [f"{PREFIX}{name}/{kind}" for name in part_names(objective) for kind in ("sq", "off_sq_max")]
    keys += [f"{PREFIX}{name}/dot_ce" for name in part_names(objective) if name != REFERENCE]
    return sorted(keys + [f"{PREFIX}{REFERENCE}/ref_sq"])


def gradient_sums(objective, stats: LogitStats, counts=None, sequence_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """This batch's additive gradient sums (`sum_keys`; 0-d float64 tensors) of `objective`'s parts
    on `stats`, with the same `counts` and `sequence_ids` as the loss (see the module docstring).

    Reads `stats` without changing it or its graph; no communication."""
    num = stats.numeric
    with torch.enable_grad(), _randomness_kept(objective, num.logits.device):
        logits = num.logits.detach().requires_grad_(True)  # [M, N]
        lse_rows = num.lse.detach().requires_grad_(True)  # [M]
        target_rows = logits.gather(1, num.target[:, None]).squeeze(1)
        probe = LogitStats(
            labels=stats.labels,
            valid=stats.valid,
            # the numeric rows' per-token statistics as functions of the leaves, so that CE, z-loss and
            # GCE see them: CE at a numeric row is lse_i - x_{i, target}
            lse=stats.lse.detach().index_put((num.rows,), lse_rows),
            target_logit=stats.target_logit.detach().index_put((num.rows,), target_rows),
            numeric=NumericRows(num.rows, num.target, logits, lse_rows),
            shape=stats.shape,
            is_numeric=stats.is_numeric,
            split=stats.split,
        )
        ce, _, parts = objective.parts(probe, counts, sequence_ids)
        probabilities = torch.exp(logits.detach() - lse_rows.detach()[:, None])  # full-vocab softmax, block
        mass_elsewhere = (1 - probabilities.sum(dim=-1)).clamp(min=0)  # [M]: off the numeric tokens

        def block(value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """(d value / d logits on the numeric block: ∂/∂x + ∂/∂lse · softmax, the bound's rows
            ∂/∂lse · m)."""
            if not value.requires_grad:
                return torch.zeros_like(probabilities), torch.zeros_like(mass_elsewhere)
            d_logits, d_lse = torch.autograd.grad(value, (logits, lse_rows), retain_graph=True, allow_unused=True)
            out = torch.zeros_like(probabilities) if d_logits is None else d_logits
            if d_lse is None:
                return out, torch.zeros_like(mass_elsewhere)
            return out + d_lse[:, None] * probabilities, d_lse * mass_elsewhere

        blocks = {name: block(value) for name, value in parts.items()}
        reference = block(ce)[0] if objective.replaces_ce else blocks[REFERENCE][0]
    sums = {f"{PREFIX}{REFERENCE}/ref_sq": _dot(reference, reference)}
    for name, (grad, off_block) in blocks.items():
        sums[f"{PREFIX}{name}/sq"] = _dot(grad, grad)
        sums[f"{PREFIX}{name}/off_sq_max"] = off_block.double().square().sum()
        if name != REFERENCE:
            sums[f"{PREFIX}{name}/dot_ce"] = _dot(grad, reference)
    return sums


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Σ a·b of two [M, N] fp32 blocks as a 0-d float64: each row's N products summed in fp32, the M rows
    in float64 (no float64 copy of the blocks; the rows add up to a step's millions of entries)."""
    return (a * b).sum(dim=-1).double().sum()


def finalize(sums: Mapping[str, float]) -> dict[str, float | None]:
    """`grad/<part>/norm`, `/share`, `/cos_ce` from gradient sums added over a whole step (the
    `grad_sums/` keys of `sums`; others are ignored). Local arithmetic: call it after the SUM."""
    names = [key[len(PREFIX):-len("/sq")] for key in sums if key.startswith(PREFIX) and key.endswith("/sq")
             and not key.endswith("/ref_sq")]
    names.sort(key=lambda name: (name != REFERENCE, name))
    norms = {name: math.sqrt(max(float(sums[f"{PREFIX}{name}/sq"]), 0.0)) for name in names}
    reference = math.sqrt(max(float(sums.get(f"{PREFIX}{REFERENCE}/ref_sq", 0.0)), 0.0))
    total = sum(norms.values())
    out: dict[str, float | None] = {}
    for name in names:
        out[f"grad/{name}/norm"] = norms[name]
        out[f"grad/{name}/share"] = norms[name] / total if total > 0 else None
        if f"{PREFIX}{name}/off_sq_max" in sums:
            out[f"grad/{name}/off_block_max"] = math.sqrt(max(float(sums[f"{PREFIX}{name}/off_sq_max"]), 0.0))
        if name != REFERENCE:
            scale = norms[name] * reference
            cos = float(sums[f"{PREFIX}{name}/dot_ce"]) / scale if scale > 0 else None
            out[f"grad/{name}/cos_ce"] = None if cos is None else min(1.0, max(-1.0, cos))
    return out


def with_numeric_block(stats: LogitStats, labels: torch.Tensor, vocab, vocab_local: int, group, vocab_start: int,
                       ignore_index: int, read: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> LogitStats:
    """Stats of a pass that skipped the numeric columns (plain CE), completed with them for the
    diagnostics alone: `read(rows, local_cols)` gives this rank's [M, n_local] logits at the numeric
    rows and its own numeric columns (detached), and one collective under TP brings every rank the
    [M, N] block (`exchange_numeric_columns`). The training loss never sees the result."""
    plan = plan_labels(labels, vocab, vocab_local, stats.lse.device, group, vocab_start, ignore_index, numeric=True)
    owned = read(plan.num_rows, plan.layout.local_cols.to(stats.lse.device)).float()
    block = exchange_numeric_columns(owned, plan.layout, group)
    return plan.stats(stats.lse.detach(), stats.target_logit.detach(), block)


@contextlib.contextmanager
def _randomness_kept(objective, device: torch.device) -> Iterator[None]:
    """Run the block and put back torch's generators (the CPU's and `device`'s) and every generator a
    term was given as an option, as they were before it."""
    generators = [value for term in objective.config.terms.values() for value in term.options.values()
                  if isinstance(value, torch.Generator)]
    states = [g.get_state() for g in generators]
    accelerator = device.type not in ("cpu", "meta")
    if accelerator:
        index = device.index if device.index is not None else torch.get_device_module(device.type).current_device()
    devices = [index] if accelerator else []
    try:
        with torch.random.fork_rng(devices=devices, device_type=device.type if accelerator else None):
            yield
    finally:
        for g, state in zip(generators, states):
            g.set_state(state)
