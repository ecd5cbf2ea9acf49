"""A Megatron-core layout (`train.engine: megatron`, tensor x pipeline x data parallel, with expert
parallelism for mixture-of-experts models): its sizes, which global rank holds which coordinate, the
groups that follow, where a group sits on the nodes, and the layouts Megatron refuses or the estimate
does not cover. recipes.planning.megatron_budget prices a layout (memory, traffic, time); this module
only says what it is and whether it can run.

Notation (as recipes.planning.megatron_budget): t = megatron.tp_size, p = pp_size, v = virtual_pp_size
(1 without interleaving), D = world / (t p) data-parallel ranks, ep = ep_size, G GPUs a node.

Rank order (read in megatron-core 0.16.1): `parallel_state.initialize_model_parallel(order="tp-cp-ep-dp-pp")`
(its docstring still says "tp-dp-pp", the same thing at context = expert parallel = 1; "tp-pp-dp" is the
only other order it supports) numbers rank = tp_rank + t (dp_rank + D pp_rank) (`RankGenerator`,
`generate_masked_orthogonal_rank_groups`). With ranks numbered node by node (G GPUs a node): a TP group
is t consecutive ranks, inside a node when t divides G; a DP group is D ranks t apart, inside a node when
t D <= G; pipeline neighbours are t D apart, on other nodes once t D >= G. The engine uses the default.
Expert parallelism (recipes.planning.moe): an EP group is ep consecutive DP ranks (t apart), the
expert-data-parallel group the D / ep DP ranks of one EP rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from recipes.planning import step_model as sm
from recipes.planning.budget import Shape
from recipes.planning.moe import MoEShape

ORDERS = ("tp-dp-pp", "tp-pp-dp")


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    vpp: int = 1  # model chunks per pipeline rank (1: no interleaving)
    sp: bool = False
    gpus_per_node: int = 8
    order: str = "tp-dp-pp"
    ep: int = 1  # expert parallel: ep consecutive DP ranks share out the experts (recipes.planning.moe)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def edp(self) -> int:
        """The expert-data-parallel size, world / (tp ep pp) = D / ep (megatron-core's)."""
        return max(1, self.dp // self.ep)


def rank_of(lay: Layout, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
    """Global rank of a (tp, dp, pp) coordinate in Megatron's order (the first name varies fastest)."""
    size, coord = {"tp": lay.tp, "dp": lay.dp, "pp": lay.pp}, {"tp": tp_rank, "dp": dp_rank, "pp": pp_rank}
    rank, stride = 0, 1
    for name in lay.order.split("-"):
        rank, stride = rank + coord[name] * stride, stride * size[name]
    return rank


def groups(lay: Layout, kind: str) -> list[list[int]]:
    """Every `kind` ("tp", "dp" or "pp") group's ranks, as megatron's RankGenerator.get_ranks(kind)."""
    out: dict[tuple, list[int]] = {}
    for i in range(lay.tp):
        for j in range(lay.dp):
            for k in range(lay.pp):
                key = tuple(c for c, n in zip((i, j, k), ("tp", "dp", "pp")) if n != kind)
                out.setdefault(key, []).append(rank_of(lay, i, j, k))
    return sorted(sorted(g) for g in out.values())


def span(lay: Layout, group: list[int]) -> tuple[int, int]:
    """(nodes the group spans, ranks it has on each node: the most on one)."""
    per_node: dict[int, int] = {}
    for r in group:
        per_node[r // lay.gpus_per_node] = per_node.get(r // lay.gpus_per_node, 0) + 1
    return len(per_node), max(per_node.values())


def split_ring(lay: Layout, group: list[int], ring_bytes: float) -> tuple[float, float]:
    """(network, NVLink) bytes of one GPU's `ring_bytes` in a collective over `group` (step_model)."""
    return sm.split_ring(ring_bytes, *span(lay, group))


def layout_problems(shape: Shape, lay: Layout, grad_accum: int, moe: MoEShape | None = None) -> list[str]:
    """Errors, each naming its keys, for a layout Megatron refuses or the estimate does not cover; with
    `moe`, expert parallelism's too (recipes.planning.moe: ep divides the experts and the DP size, tp
    the experts' width)."""
    out = []
    if shape.layers % (lay.pp * lay.vpp):
        out.append(f"megatron.pp_size x megatron.virtual_pp_size: {lay.pp} x {lay.vpp} does not divide the "
                   f"model's {shape.layers} layers")
    if moe is None:
        widths = [("intermediate size", shape.intermediate)]
        if lay.ep > 1:
            out.append(f"megatron.ep_size: {lay.ep} > 1, but the model has no experts (a dense MLP)")
    else:
        widths = [("experts' intermediate size (moe_intermediate_size)" if moe.family != "mixtral" else
                   "experts' intermediate size", moe.expert_intermediate)]
        widths += [("shared expert's intermediate size", moe.shared_intermediate)] * bool(moe.shared_intermediate)
        widths += [("dense layers' intermediate size", moe.dense_intermediate)] * (moe.moe_layers < moe.layers)
        if moe.experts % lay.ep:
            out.append(f"megatron.ep_size: {lay.ep} does not divide the model's {moe.experts} experts")
        if lay.dp % lay.ep:
            out.append(f"megatron.ep_size: {lay.ep} does not divide the data-parallel size {lay.dp} = world / (tp x pp)"
                       f" (megatron-core lays the experts out as tp x ep x pp x world / (tp ep pp))")
    for what, n in (("attention heads", shape.heads), ("KV heads (query groups)", shape.kv_heads), *widths):
        if n % lay.tp:
            out.append(f"megatron.tp_size: {lay.tp} does not divide the model's {n} {what}")
    if lay.vpp > 1 and grad_accum % lay.pp:
        out.append(f"train.grad_accum: {grad_accum} micro-batches must be a multiple of megatron.pp_size "
                   f"{lay.pp} under interleaving (megatron.virtual_pp_size {lay.vpp}: Megatron's micro-batch "
                   "groups per virtual stage)")
    return out
