"""Evaluation during training: every `eval.every` optimizer steps, the held-out build (`eval.data`, else
`data.eval`) through the engine's forward only, logged in the step's metrics.jsonl row and TensorBoard:

- eval/loss, eval/ce, eval/term/<name>: the training objective on the held-out rows, normalised over all of
  them on every data-parallel rank (as a training step over one global batch of those rows), no gradient.
- eval/exact_match, eval/mae, eval/parse_rate, eval/n: the teacher-forced answer of each row with a numeric
  answer: the argmax token at each of its label positions, decoded and read with `data_prep.answers`
  (the reader of numloss's evaluation) against the row's answer. When every argmax token is the gold one,
  greedy decoding writes exactly that answer, so a row right here is right under greedy generation whenever
  the answer's tokens are the gold ones; the MAE is of the teacher-forced answers (each digit predicted after
  the gold digits before it), a cheaper and steadier proxy of the generated answers' MAE, not the same number.
  `python -m recipes.evaluate` on the export gives the generated answers' metrics.

The held-out rows are read in manifest order (no shuffle), `train.micro_batch_size` per rank and micro-batch,
whole global batches only (every rank runs the same forwards: a ZeRO-3 or tensor-parallel forward is a
collective), at most `eval.limit` rows. The training is unchanged: the engine's `eval_step` runs without
gradients, in eval mode, restores the training mode, and the RNG state of every device is restored after
(`torch.random.fork_rng`), so the training losses with and without it are the same.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.distributed as dist

from data_prep.answers import parse_answer
from data_prep.reader import ShardDataset
from recipes.inputs.batches import model_inputs

from .parallel import reduce_sum

PREFIX = "eval/"


def vocab_parallel_argmax(logits: torch.Tensor, group=None, real_vocab_size: int | None = None) -> torch.Tensor:
    """The argmax token id over the last dimension of logits split over `group` along the vocabulary, the
    ranks' column ranges in rank order; the lowest id among equal maxima, as torch.argmax. Columns at or past
    `real_vocab_size` (a padded vocabulary) never win. `group` None: the logits are the whole vocabulary."""
    vocab_start = 0
    if group is not None and dist.get_world_size(group) > 1:
        widths = [torch.zeros((), dtype=torch.long, device=logits.device) for _ in range(dist.get_world_size(group))]
        dist.all_gather(widths, torch.tensor(logits.shape[-1], device=logits.device), group=group)
        vocab_start = int(sum(w for w in widths[:dist.get_rank(group)]))
    local = logits.float()
    if real_vocab_size is not None and vocab_start + local.shape[-1] > real_vocab_size:
        local = local.clone()
        local[..., max(real_vocab_size - vocab_start, 0):] = -math.inf
    value, index = local.max(dim=-1)
    index = index + vocab_start
    if group is None or dist.get_world_size(group) == 1:
        return index
    best = value.clone()
    dist.all_reduce(best, op=dist.ReduceOp.MAX, group=group)
    candidate = torch.where(value == best, index, torch.full_like(index, torch.iinfo(index.dtype).max))
    dist.all_reduce(candidate, op=dist.ReduceOp.MIN, group=group)
    return candidate


def answer_tokens(predicted: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> list[list[int]]:
    """Per row, the predicted tokens at its scored positions: `predicted[b, i]` is the model's token for
    `labels[b, i]` (both aligned: shifted labels with the logits' positions)."""
    keep = labels != ignore_index
    return [predicted[b][keep[b]].tolist() for b in range(labels.shape[0])]


def answer_sums(answers: Sequence[list[int]], targets: Sequence[float], tokenizer) -> dict[str, float]:
    """This rank's sums of the numeric metrics: rows with a numeric answer, hits, parsed, absolute errors."""
    sums = {"n": 0.0, "hits": 0.0, "parsed": 0.0, "abs_error": 0.0}
    for tokens, target in zip(answers, targets):
        if target is None or not math.isfinite(target):
            continue
        value = parse_answer(tokenizer.decode(tokens, skip_special_tokens=True))
        sums["n"] += 1
        if value is not None:
            sums["parsed"] += 1
            sums["abs_error"] += abs(value - target)
            sums["hits"] += math.isclose(value, target, rel_tol=1e-9, abs_tol=1e-9)
    return sums


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


class HeldOut:
    """The held-out rows of this data-parallel rank and how to score them; `evaluate` is a collective."""

    def __init__(self, recipe, engine, device: torch.device):
        path = recipe.eval.data or recipe.data.eval
        if not path:
            raise ValueError("eval.every: needs held-out data: set eval.data (or data.eval) to a data_prep build")
        if not callable(getattr(engine, "eval_step", None)):
            raise ValueError(f"eval.every: the {engine.name} engine has no eval_step")
        problem = engine.eval_problem()
        if problem is not None:  # before the first step, not at the first evaluation
            raise ValueError(f"eval.every: {problem}; set eval.every: 0")
        dp = engine.dp
        per_step = recipe.train.micro_batch_size * dp.size
        self.dataset = ShardDataset(path, batch_size=recipe.train.micro_batch_size, rank=dp.rank, world_size=dp.size,
                                    global_batch_size=per_step, shuffle=False, drop_last=True,
                                    seq_len=recipe.data.seq_len, pad_to_multiple_of=recipe.data.pad_to_multiple_of,
                                    pad_id=engine.tokenizer.pad_token_id, verify=recipe.data.verify)
        if self.dataset.packed:
            raise ValueError(f"eval.every: {path} is packed; held-out rows are scored one answer per row: build "
                             "the eval split without --pack-length")
        rows = self.dataset.num_rows if recipe.eval.limit is None else min(recipe.eval.limit, self.dataset.num_rows)
        self.batches = rows // per_step  # whole global batches: every rank runs the same forwards
        if self.batches == 0:
            raise ValueError(f"eval.every: {path} has {rows} rows to score, fewer than one global batch "
                             f"({per_step} = train.micro_batch_size x {dp.size} data-parallel ranks)")
        self.engine, self.device = engine, device
        self._cached: tuple[list[dict], list[float | None]] | None = None

    def _window(self) -> tuple[list[dict], list[float | None]]:
        """The held-out micro-batches of this rank as model inputs on the device, and their rows' answers
        (read once, kept: the same rows every time)."""
        if self._cached is not None:
            return self._cached
        self.dataset.set_epoch(0)
        window, targets = [], []
        for k, batch in enumerate(iter(self.dataset)):
            if k >= self.batches:
                break
            inputs, _ = model_inputs(batch, **self.engine.batch_options)
            window.append({key: v.to(self.device) if torch.is_tensor(v) else v for key, v in inputs.items()})
            targets += [None if not math.isfinite(a) else float(a) for a in batch["answer"].tolist()]
        self._cached = (window, targets)
        return self._cached

    def evaluate(self) -> dict[str, Any]:
        """The eval/* values of the held-out rows (every rank returns the same)."""
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            window, targets = self._window()
            sums, answers = self.engine.eval_step(window)
        values = {**{f"loss/{k}": v for k, v in sums.items()},
                  **{f"answers/{k}": v for k, v in answer_sums(answers, targets, self.engine.tokenizer).items()}}
        total = reduce_sum(values, self.device, self.engine.dp.group)
        row: dict[str, Any] = {f"{PREFIX}{k[len('loss/'):]}": v for k, v in total.items() if k.startswith("loss/")}
        n, parsed = total["answers/n"], total["answers/parsed"]
        row.pop(f"{PREFIX}numeric_positions", None)
        row.update({f"{PREFIX}n": int(n),
                    f"{PREFIX}exact_match": total["answers/hits"] / n if n else None,
                    f"{PREFIX}parse_rate": parsed / n if n else None,
                    f"{PREFIX}mae": total["answers/abs_error"] / parsed if parsed else None})
        return {k: _finite_or_none(v) if isinstance(v, float) else v for k, v in row.items()}
