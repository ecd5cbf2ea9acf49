"""The plain torch engine's contract: no section of its own, one process, a plan from the step model, and
the two report lines `python -m recipes.validate` asks of every engine. Pure: no torch at module level."""

from __future__ import annotations

from types import SimpleNamespace

from recipes.engines.contract import EngineContract
from recipes.planning import step_model
from recipes.planning.placement import Placement
from recipes.planning.plan import Plan
from recipes.planning.shape import Shape

NAME = "plain_torch"


def world_problems(world: int) -> list[str]:
    return [] if world == 1 else [f"train.engine: {NAME} runs one process; the cluster gives {world} ranks "
                                  "(set cluster.nodes 1 and one rank per node)"]


def plan(recipe, model_cfg, *, hardware, rows, params=None, **options) -> Plan:
    """fp32 weights, gradients and AdamW's two moments (16 bytes a parameter); the step's compute at the
    step model's rates, every micro-batch at the longest rows."""
    shape = Shape.of(model_cfg)
    total = params[0] if params else shape.layers * step_model.layer_matmul_params(shape)
    t = recipe.train
    compute = step_model.micro_batch_compute(shape, rows=t.micro_batch_size, length=rows.peak, tp=1,
                                             layers=shape.layers, hw=hardware, kernels_per_layer=120, head=True)
    return Plan(NAME, Placement.of(1, 1, 1), memory={"model states": 16 * total}, step_s=compute.seconds * t.grad_accum,
                flops=compute.flops * t.grad_accum, limit="compute")


def layout_line(rep, recipe, cfg) -> tuple[int, str]:
    world = recipe.cluster.nodes * recipe.cluster.ranks_per_node()
    rep.refuse_layout(world_problems(world))
    return 1, f"{world} rank(s), one process: plain torch"


def add_plan(rep, recipe, cfg, total, largest, *, hw, rows, adapter=None, moe_imbalance=1.0) -> Plan:
    pl = plan(recipe, cfg, hardware=hw, rows=rows, params=(total, largest))
    rep.add("step time", f"{pl.step_s:.3f} s, {pl.total / 2**30:.1f} GiB of model states")
    return pl


class PlainTorchContract(EngineContract):
    name = NAME
    report = SimpleNamespace(layout_line=layout_line, add_plan=add_plan)
    runtime_class = "tests.recipes.engines.plain_torch.runtime.engine:PlainTorchEngine"
    plan = staticmethod(plan)

    def layout_problems(self, recipe, model_cfg, world_size: int | None = None) -> list[str]:
        return world_problems(world_size) if world_size is not None else []
