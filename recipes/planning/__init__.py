"""Planning a run before it is launched: `validate` (the static checks of `recipes.checks`, then memory,
disk, traffic and the step model's time per GPU, and a recommended layout), the cost models (`budget`,
`megatron_budget` on `megatron_layout`, `step_model`, `gemm_rates`, `padding`) and their reports. May
import numloss, recipes.config, recipes.checks, recipes.training and recipes.engines."""
