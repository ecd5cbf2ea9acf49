"""Where the ranks of a parallel layout sit: `Placement`, a `recipes.parallel_dims.ParallelDims` on nodes of
`gpus_per_node` ranks in a rank order, which global rank holds which (tp, dp, pp) coordinate, the groups
that follow and how many nodes a group spans. The engines' cost models
(recipes.engines.<engine>.costs) price a placement: a group inside a node talks over NVLink, one across nodes over the NICs.

Notation: t = tp, p = pp, D = world / (t p) data-parallel ranks, G ranks a node.

Rank order (read in megatron-core 0.16.1): `parallel_state.initialize_model_parallel(order="tp-cp-ep-dp-pp")`
(its docstring still says "tp-dp-pp", the same thing at context = expert parallel = 1; "tp-pp-dp" is the
only other order it supports) numbers rank = tp_rank + t (dp_rank + D pp_rank) (`RankGenerator`,
`generate_masked_orthogonal_rank_groups`). With ranks numbered node by node (G GPUs a node): a TP group
is t consecutive ranks, inside a node when t divides G; a DP group is D ranks t apart, inside a node when
t D <= G; pipeline neighbours are t D apart, on other nodes once t D >= G. Both engines use the default
(DeepSpeed's AutoTP groups are t consecutive ranks too, its data-parallel groups t apart).
Expert parallelism (recipes.planning.moe): an EP group is ep consecutive DP ranks (t apart), the
expert-data-parallel group the D / ep DP ranks of one EP rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from recipes.parallel_dims import ParallelDims
from recipes.planning import step_model

ORDERS = ("tp-dp-pp", "tp-pp-dp")


@dataclass(frozen=True)
class Placement:
    """A parallel layout (`dims`) on nodes of `gpus_per_node` ranks, numbered in `order`."""

    dims: ParallelDims
    gpus_per_node: int = 8
    order: str = "tp-dp-pp"

    @classmethod
    def of(cls, tp: int = 1, pp: int = 1, dp: int = 1, vpp: int = 1, sp: bool = False, gpus_per_node: int = 8,
           order: str = "tp-dp-pp", ep: int = 1) -> "Placement":
        """The placement of tp x pp x dp ranks at these degrees."""
        return cls(ParallelDims(world=tp * pp * dp, tp=tp, pp=pp, vpp=vpp, ep=ep, sp=sp, dp=dp), gpus_per_node, order)

    @property
    def tp(self) -> int:
        return self.dims.tp

    @property
    def pp(self) -> int:
        return self.dims.pp

    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def vpp(self) -> int:
        return self.dims.vpp

    @property
    def sp(self) -> bool:
        return self.dims.sp

    @property
    def ep(self) -> int:
        return self.dims.ep

    @property
    def edp(self) -> int:
        """The expert-data-parallel size, world / (tp ep pp) = D / ep (megatron-core's)."""
        return self.dims.edp

    @property
    def world(self) -> int:
        return self.dims.world

    @property
    def nodes(self) -> int:
        return -(-self.world // self.gpus_per_node)


def rank_of(lay: Placement, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
    """Global rank of a (tp, dp, pp) coordinate in the placement's order (the first name varies fastest)."""
    size, coord = {"tp": lay.tp, "dp": lay.dp, "pp": lay.pp}, {"tp": tp_rank, "dp": dp_rank, "pp": pp_rank}
    rank, stride = 0, 1
    for name in lay.order.split("-"):
        rank, stride = rank + coord[name] * stride, stride * size[name]
    return rank


def groups(lay: Placement, kind: str) -> list[list[int]]:
    """Every `kind` ("tp", "dp" or "pp") group's ranks, as megatron's RankGenerator.get_ranks(kind)."""
    out: dict[tuple, list[int]] = {}
    for i in range(lay.tp):
        for j in range(lay.dp):
            for k in range(lay.pp):
                key = tuple(c for c, n in zip((i, j, k), ("tp", "dp", "pp")) if n != kind)
                out.setdefault(key, []).append(rank_of(lay, i, j, k))
    return sorted(sorted(g) for g in out.values())


def span(lay: Placement, group: list[int]) -> tuple[int, int]:
    """(nodes the group spans, ranks it has on each node: the most on one)."""
    per_node: dict[int, int] = {}
    for r in group:
        per_node[r // lay.gpus_per_node] = per_node.get(r // lay.gpus_per_node, 0) + 1
    return len(per_node), max(per_node.values())


def split_ring(lay: Placement, group: list[int], ring_bytes: float) -> tuple[float, float]:
    """(network, NVLink) bytes of one GPU's `ring_bytes` in a collective over `group` (step_model)."""
    return step_model.split_ring(ring_bytes, *span(lay, group))


def where(lay: Placement, kind: str) -> str:
    """Where the first `kind` ("tp", "dp", "pp") group sits, in words."""
    size = {"tp": lay.tp, "dp": lay.dp, "pp": lay.pp}[kind]
    if size == 1:
        return "of size 1"
    nodes, g = span(lay, groups(lay, kind)[0])
    return "inside a node" if nodes == 1 else f"across {nodes} nodes, {g} rank(s) per node"
