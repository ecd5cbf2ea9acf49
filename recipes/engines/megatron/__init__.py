"""The Megatron-core engine: GPTModel built from HF configs/weights, TP, PP, SP, EP, the distributed
optimizer.

`pure/` (floor 4: no torch or megatron at module level): `contract` (its section, refusals, adopted
settings, checkpoint rules), `layout` (its ParallelDims and the layouts a model's shape cannot take),
`plan` (its memory and time plan), `costs` (its cost model), `report` (validate's lines of its plan),
`support` (which HF families convert; a converted directory's checks), `kernels` (the layer spec and
fused kernels a machine runs). `runtime/` (floor 7: torch and megatron.core; may import up to
recipes.reliability): `model`, `convert` (HF <-> Megatron state dicts), `converted` (the one-time
conversion), `rope`, `moe`, `batches`, `step`, `checkpoints`, `export`, `cpu_shim`, `context`, `engine`."""
