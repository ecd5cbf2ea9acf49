"""What the Trainer integration (`numloss.integrations.hf_trainer`) computes and logs: the sums logged
for each training micro-batch's share of its optimizer step's objective, the objective of a whole
evaluation set (from logits), and the token metrics TRL's SFTTrainer logs (entropy, top-1 accuracy,
tokens seen), from the same forward's logits or hidden states, so that no second forward is needed.
Passes over the vocabulary without gradient are cut into chunks sized in bytes (`METRIC_CHUNK_BYTES`).

Parallel contract: every process is one data-parallel rank holding full logits (or full hidden states and,
inside the model's forward, the gathered LM head weight). `StepLoss.take_logged` is one SUM all-reduce over the default process group (every rank calls it at the same log);
`EvalSums.add` hands its per-row sums to the Trainer's `gather_for_metrics` (one all-gather per
evaluated batch on every rank, which also drops the rows accelerate repeats to even out the last
batch); nothing else communicates.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..adapters.deepspeed_autotp import causal_lm_objective
from ..logit_stats import compute_logit_stats
from ..logit_transform import LogitTransform
from ..normalization import TOKENS, LossCounts
from ..objective import Objective, ObjectiveOutput

# Bytes of one chunk's fp32 temporaries in a no-gradient pass over the vocabulary (the entropy / top-1
# metrics): a chunk's row count comes from the vocabulary size, so a 128k vocabulary gets as few bytes as a
# 32k one (sized in rows, 4096 rows at V = 128,256 held four [2048, V] fp32 copies, 4 GiB, beside the step).
METRIC_CHUNK_BYTES = 64 << 20
METRIC_COPIES = 2  # fp32 [rows, V] tensors alive at once in `_entropy_top1` (the logits and their exp)


def metric_chunk_rows(vocab: int, extra_bytes_per_entry: int = 0) -> int:
    """Rows per chunk of a metrics pass over `vocab` columns: METRIC_CHUNK_BYTES over the bytes a row
    holds (`METRIC_COPIES` fp32 copies, plus `extra_bytes_per_entry`: the low-precision product the
    fp32 copy is made from)."""
    return max(1, METRIC_CHUNK_BYTES // (max(vocab, 1) * (4 * METRIC_COPIES + extra_bytes_per_entry)))


def _entropy_top1(x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(entropy [r], label is the top-1 token [r]) of fp32 logits `x` [r, V], which this overwrites. The
    first maximal column counts as the top-1 (argmax's rule, and TRL's `is_top1`)."""
    top1 = x.argmax(-1) == labels
    x.sub_(x.amax(-1, keepdim=True))
    p = x.exp()
    total = p.sum(-1)
    # -Σ p log p with p = e^x / Σ e^x: log Σ e^x - Σ e^x · x / Σ e^x
    entropy = total.log() - p.mul_(x).sum(-1) / total
    return entropy, top1


def token_metric_sums(logits: torch.Tensor, shifted: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """[B, 3] float64 per row: the summed entropy of the model's next-token distribution, the number of
    positions whose top-1 token is the label, and the number of positions with a label (TRL's
    `entropy`, `mean_token_accuracy` and their denominator), over the positions whose (shifted) label
    is not `ignore_index`. No gradient; the full-vocab pass runs on those positions only, in chunks of
    `metric_chunk_rows` rows."""
    with torch.no_grad():
        rows, vocab = logits.shape[0], logits.shape[-1]
        valid = (shifted != ignore_index).reshape(-1)
        where = valid.nonzero().squeeze(1).to(logits.device)
        flat = logits.reshape(-1, vocab)
        labels = shifted.reshape(-1).to(logits.device)
        seq = logits.shape[1] if logits.dim() == 3 else 1
        out = torch.zeros(rows, 3, dtype=torch.float64, device=logits.device)
        for chunk in where.split(metric_chunk_rows(vocab, logits.element_size())):
            entropy, top1 = _entropy_top1(flat[chunk].float(), labels[chunk])
            values = torch.stack([entropy, top1.float(), torch.ones_like(entropy)], dim=1)
            out.index_add_(0, chunk // seq, values.double())
        return out


def hidden_token_metric_sums(hidden: torch.Tensor, weight: torch.Tensor, shifted: torch.Tensor, ignore_index: int,
                             transform: LogitTransform | None = None) -> torch.Tensor:
    """[3] float64: `token_metric_sums` summed over the rows, from hidden states [..., H] and the LM head's
    weight [V, H] (its logits under `transform`, the model's scale / soft cap) instead of logits: the
    labelled positions' logits are made `metric_chunk_rows` rows at a time and never for the batch.
    No gradient."""
    with torch.no_grad():
        valid = shifted != ignore_index
        h = hidden[valid.to(hidden.device)]
        labels = shifted[valid].to(hidden.device)
        sums = torch.zeros(3, dtype=torch.float64, device=hidden.device)
        rows = metric_chunk_rows(weight.shape[0], weight.element_size() if weight.dtype != torch.float32 else 0)
        for start in range(0, h.shape[0], rows):
            x = (h[start:start + rows] @ weight.t()).float()
            if transform is not None:
                transform.apply_(x)
            entropy, top1 = _entropy_top1(x, labels[start:start + rows])
            sums[0] += entropy.double().sum()
            sums[1] += top1.double().sum()
        sums[2] = float(labels.numel())
        return sums


def input_tokens(inputs: dict) -> int:
    """The tokens a micro-batch holds, as TRL's `num_tokens` counts them: the attention mask's ones, or
    under padding-free packing (no mask) the packed row's length."""
    if inputs.get("attention_mask") is not None:
        return int(inputs["attention_mask"].sum())
    if inputs.get("position_ids") is not None:
        return int(inputs["position_ids"].shape[1])
    raise ValueError("numloss: an SFT batch has neither `attention_mask` nor `position_ids` to count its tokens")


class StepLoss:
    """The training loss's logged sums: `record(out)` adds a micro-batch's `ObjectiveOutput` (its share
    of the step's objective, computed over the step's `LossCounts`) to the sums `take_logged` returns.
    With `token_metrics` (SFTTrainer) `add_token_metrics` adds TRL's entropy / accuracy / token sums."""

    def __init__(self, objective: Objective, token_metrics: bool = False):
        self.objective = objective
        self.token_metrics = token_metrics
        self.keys = ["ce", *(f"term/{name}" for name in objective.config.terms), "numeric_positions"]
        if token_metrics:
            self.keys += ["entropy_sum", "top1", "labelled", "tokens"]
        self._sums: torch.Tensor | None = None
        self.last: torch.Tensor | None = None
        self.tokens_seen = 0.0  # every process's training tokens so far, for TRL's cumulative `num_tokens`

    def _add(self, index: int, values: torch.Tensor) -> None:
        if self._sums is None:
            self._sums = torch.zeros(len(self.keys), dtype=torch.float64, device=values.device)
        self._sums[index:index + values.numel()] += values.to(self._sums.device)

    def record(self, out: ObjectiveOutput) -> ObjectiveOutput:
        values = torch.stack([out.ce.detach(), *(v.detach() for v in out.terms.values())]).double()
        self._add(0, torch.cat([values, values.new_tensor([out.numeric_positions])]))
        self.last = values  # CE and each term of the last micro-batch (its shares of the step's)
        return out

    def own_values(self, step_counts: LossCounts, batch_counts: LossCounts) -> tuple[float, dict[str, float]]:
        """(CE, {term: value}) of the last recorded micro-batch over its own counts (`batch_counts`), from
        its shares of the step's (`step_counts`): a share is the batch's sum over the step's count."""
        keys = self.objective.denominator_keys()
        shares = self.last.tolist()

        def own(share: float, key: str) -> float:
            return share * step_counts.denominator(key) / batch_counts.denominator(key)

        names = list(self.objective.config.terms)
        return own(shares[0], keys["ce"]), {name: own(v, keys[name]) for name, v in zip(names, shares[1:])}

    def micro_batch(self, logits: torch.Tensor, shifted: torch.Tensor, counts: LossCounts) -> ObjectiveOutput:
        """The objective on a causal LM's logits; `shifted`: the labels aligned with `logits`."""
        return self.record(causal_lm_objective(self.objective, logits, shifted_labels=shifted.to(logits.device),
                                               counts=counts))

    def add_token_metrics(self, sums: torch.Tensor, tokens: int) -> None:
        """`sums`: [3] (entropy sum, top-1 count, labelled positions) of a micro-batch; `tokens`: its input tokens."""
        self._add(self.keys.index("entropy_sum"), torch.cat([sums.double(), sums.new_tensor([tokens]).double()]))

    def take_logged(self, steps: int) -> dict[str, float]:
        """The global batch's `ce`, `term/*`, `numeric_positions` summed over the steps since the last
        call and over the processes (one SUM all-reduce: every rank calls it at the same log), divided by
        `steps`; with token metrics also `entropy` and `mean_token_accuracy` over every labelled
        position since the last call and the cumulative `num_tokens`. Then the sums start again."""
        if self._sums is None or steps == 0:
            return {}
        sums, self._sums = self._sums, None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        values = dict(zip(self.keys, sums.tolist()))
        out = {key: values[key] / steps for key in self.keys[:len(self.objective.config.terms) + 2]}
        if self.token_metrics:
            labelled = values["labelled"]
            out["entropy"] = values["entropy_sum"] / labelled if labelled else 0.0
            out["mean_token_accuracy"] = values["top1"] / labelled if labelled else 0.0
            self.tokens_seen += values["tokens"]
            out["num_tokens"] = self.tokens_seen
        return out


class EvalSums:
    """The objective of a whole evaluation set: every term's sum over every evaluated position of every
    process, divided by the set's own global count of its kind (the same `LossCounts` keys as
    training), so the value does not depend on the evaluation batch size or the number of processes.

    `rows(logits, shifted)` gives each row's sums ([B, K] float64: each part of the total with unit
    denominators, CE, each term, each count, the numeric positions, and with token metrics the entropy
    and top-1 sums); `add` keeps the rows the Trainer's `gather_for_metrics` returns; `result` divides.
    A row's sums come from the objective on that row alone (the objective's terms are sums over
    positions, and over sequences for NTIL, so rows add up exactly); a term with `rescale_to_ce` enters
    as its per-row value `w · CE` (rows without a numeric position add 0, as in a training micro-batch
    without one)."""

    def __init__(self, objective: Objective, token_metrics: bool = False):
        self.objective = objective
        self.token_metrics = token_metrics
        config = objective.config
        keys = objective.denominator_keys()
        self.count_keys = sorted(set(keys.values()))
        self._unit = LossCounts({key: 1.0 for key in self.count_keys})
        # the parts of the total (Objective.parts) and the count each divides by
        self.part_keys = {"ce": TOKENS}
        for name, term in config.terms.items():
            self.part_keys[name] = TOKENS if term.rescale_to_ce else keys[name]
        if config.z_loss:
            self.part_keys["z_loss"] = TOKENS
        self.terms = list(config.terms)
        self.total: torch.Tensor | None = None

    def rows(self, logits: torch.Tensor, shifted: torch.Tensor) -> torch.Tensor:
        """`shifted`: the labels aligned with `logits`."""
        config = self.objective.config
        shifted = shifted.to(logits.device)
        out = []
        with torch.no_grad():
            for row in range(logits.shape[0]):
                stats = compute_logit_stats(logits[row:row + 1], shifted[row:row + 1], self.objective.vocab,
                                            ignore_index=config.ignore_index, numeric=bool(config.terms))
                ce, values, parts = self.objective.parts(stats, self._unit)
                counts = self.objective.counts(shifted[row:row + 1])
                out.append(torch.stack([
                    *(parts[name].detach().double() for name in self.part_keys),
                    ce.detach().double() + (parts["z_loss"].detach().double() if "z_loss" in parts else 0.0),
                    *(values[name].detach().double() for name in self.terms),
                    *(torch.tensor(counts[key], dtype=torch.float64, device=logits.device) for key in self.count_keys),
                    torch.tensor(float(stats.numeric.count), dtype=torch.float64, device=logits.device),
                ]))
            sums = torch.stack(out)
            if self.token_metrics:
                sums = torch.cat([sums, token_metric_sums(logits, shifted, config.ignore_index)[:, :2]], dim=1)
        return sums

    def add(self, gathered_rows: torch.Tensor) -> None:
        total = gathered_rows.sum(0)
        self.total = total if self.total is None else self.total + total

    def result(self, total: torch.Tensor | None = None) -> dict[str, float]:
        """`loss`, `ce`, `term/<name>`, `numeric_positions` (and `entropy`, `mean_token_accuracy`) of the
        rows summed in `total` (default: every row added so far); {} when nothing was added."""
        total = self.total if total is None else total
        if total is None:
            return {}
        values = iter(total.tolist())
        parts = {name: next(values) for name in self.part_keys}
        ce = next(values)
        terms = {name: next(values) for name in self.terms}
        counts = {key: next(values) for key in self.count_keys}
        numeric_positions = next(values)

        def per(key: str) -> float:
            return counts[key] if counts[key] > 0 else 1.0  # as LossCounts.denominator

        keys = self.objective.denominator_keys()
        out = {"loss": sum(value / per(self.part_keys[name]) for name, value in parts.items()),
               "ce": ce / per(TOKENS), **{f"term/{name}": terms[name] / per(keys[name]) for name in self.terms},
               "numeric_positions": numeric_positions}
        if self.token_metrics:
            entropy, top1 = next(values), next(values)
            out["entropy"] = entropy / per(TOKENS)
            out["mean_token_accuracy"] = top1 / per(TOKENS)
        return out
