"""The one result of planning: what one layout of a recipe costs per GPU, whichever engine runs it.

Every engine's plan (`recipes.engines.<engine>.plan.plan`, through its contract) returns a `Plan`, so
the run log, the recommender and `recipes.validate` read memory, time, MFU and traffic the same way:

- `memory`: bytes per GPU by part on the GPU that holds the most (a pipeline's peak stage), `total` their
  sum. What a GPU may fill is the caller's (recipes.planning.device_memory).
- `step_s` and `parts`: the predicted seconds of one optimizer step and the terms it is made of
  (recipes.planning.step_model.dominant_terms prints the largest); `limit` names what bounds it.
- `mfu`: model FLOPs of the real tokens (`model_flops`, all GPUs, no recompute, no padding) over the
  step time x GPUs x peak; `flops`: what one GPU executes per step (recompute and padding included).
- `net_bytes`, `nvlink_bytes`: what the busiest GPU sends per step over the network and inside the node.
- `padding_ratio`: tokens run / real tokens; `rate`: the typical micro-batch's GEMM TFLOP/s.
- `checkpoint_bytes`: one checkpoint on disk (None: the engine's plan does not size it).
- `notes`: what the estimate assumes about the recipe that the reader should know (a setting the engine
  ignores, a part estimated as asked rather than as run).
An engine adds what only it has: `collectives` (each kind of collective of the step), `stages` (one
per pipeline stage: `Stage`), `bubble`, `t_compute` / `t_comm` (DeepSpeed's compute and communication
that overlap: the step is the longer), `dp_ring` / `pp_ring` (where the groups sit).
An untimed plan (memory only) has `step_s` infinite and no parts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from recipes.planning.placement import Placement


@dataclass
class Stage:
    """One GPU of a pipeline stage: its parameters and memory by part, the bytes it moves per step and the
    seconds of a typical micro-batch on it (recipes.engines.megatron.pure.costs)."""

    index: int
    params: float
    memory: dict = field(default_factory=dict)  # part -> bytes
    tp_bytes: float = 0.0  # per step, NVLink
    pp_inter: float = 0.0  # per step
    pp_intra: float = 0.0
    dp_inter: float = 0.0
    dp_intra: float = 0.0
    flops_mb: float = 0.0  # per micro-batch, recompute included
    t_compute: float = 0.0  # seconds per micro-batch
    t_tp: float = 0.0
    t_p2p: float = 0.0
    t_dp_exposed: float = 0.0
    expert_params: float = 0.0  # of `params`: the routed experts' (model states sharded over edp)
    ep_inter: float = 0.0  # per step, EP all-to-alls: the busiest EP rank's heavier side (recipes.planning.moe)
    ep_intra: float = 0.0
    t_ep: float = 0.0  # seconds per micro-batch
    expert_activations: float = 0.0  # of `memory`: on the tokens the busiest EP rank's experts receive

    @property
    def total(self) -> float:
        return sum(self.memory.values())

    @property
    def t_mb(self) -> float:
        return self.t_compute + self.t_tp + self.t_p2p + self.t_ep


@dataclass
class Plan:
    """What one layout costs per GPU (module docstring). `placement`: the parallel layout priced and where
    its ranks sit; `settings`: the engine's own settings priced (its cost model's type), for the reports."""

    engine: str
    placement: Placement
    memory: dict = field(default_factory=dict)  # part -> bytes per GPU, the GPU that holds the most
    step_s: float = math.inf
    parts: dict = field(default_factory=dict)  # seconds per step by term: what the step time is made of
    mfu: float = 0.0
    model_flops: float = 0.0  # per step, all GPUs, real tokens, no recompute
    flops: float = 0.0  # per GPU per step, recompute and padding included
    tokens: float = 0.0  # real tokens per step, all GPUs
    padding_ratio: float = 1.0  # tokens run / real tokens
    rate: float = 0.0  # TFLOP/s of the typical micro-batch's GEMMs
    limit: str = ""
    net_bytes: float = 0.0  # per step, the busiest GPU, over the network
    nvlink_bytes: float = 0.0  # per step, the busiest GPU, inside the node
    checkpoint_bytes: float | None = None
    notes: list[str] = field(default_factory=list)
    settings: Any = None
    collectives: list = field(default_factory=list)  # step_model.Collective, every kind of the step
    stages: list[Stage] = field(default_factory=list)  # pipeline stages (empty: no pipeline)
    bubble: float = 0.0  # idle fraction of the step
    t_compute: float = 0.0  # seconds per step, where compute and communication overlap
    t_comm: float = 0.0
    dp_ring: str = ""  # where the data-parallel group sits
    pp_ring: str = ""

    @property
    def total(self) -> float:
        """Bytes per GPU on the GPU that holds the most."""
        return sum(self.memory.values())

    @property
    def world(self) -> int:
        return self.placement.world

    @property
    def peak(self) -> Stage | None:
        """The pipeline stage that holds the most (None without stages)."""
        return max(self.stages, key=lambda st: st.total) if self.stages else None

    def fits(self, mem_gib: float) -> bool:
        """Whether its GPUs hold it in `mem_gib` GiB (what a plan may fill: recipes.planning.device_memory)."""
        return self.total <= mem_gib * 2**30


@dataclass
class Candidate:
    """One layout a recommendation weighed: its engine, what it is, the recipe overrides that select it
    (`override`), its plan."""

    engine: str
    text: str
    settings: list[str]
    plan: Plan


def override(key: str, value) -> str:
    """The `key=value` override that sets a recipe key to `value`, spelt as YAML reads it (null, true)."""
    text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    return f"{key}={text}"


def divisors(n: int, most: int | None = None) -> list[int]:
    """The divisors of `n`, up to `most`: the degrees and splits a candidate layout may take."""
    return [d for d in range(1, n + 1) if n % d == 0 and (most is None or d <= most)]
