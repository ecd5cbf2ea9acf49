"""What a run costs before it is launched, from numbers and shapes alone: the model's shape (`shape`,
`moe`), where a layout's ranks sit (`placement`, on `recipes.parallel_dims.ParallelDims`), the memory a
layer and the head keep (`memory`), GEMM rates (`gemm_rates`), padding (`padding`), the step model's
time, traffic and MFU (`step_model`; each engine's cost model, `recipes.engines.<engine>.costs`, builds
on it), the GPU memory a plan may fill (`device_memory`), LoRA's adapter (`lora`), the backbones' configs and
parameter counts (`backbones`), and the one result of all of it, `Plan` (`plan`). No recipe loading
here, and no engine: the engines' plans (`recipes.engines.<engine>.plan`) read a recipe into these, and
`recipes.validation` prints them. May import numloss and recipes.parallel_dims, nothing else of the
project."""

from recipes.planning.plan import Candidate, Plan, Stage

__all__ = ["Candidate", "Plan", "Stage"]
