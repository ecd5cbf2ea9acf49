"""The parts of the training loop every engine shares: process set-up (`runtime`), data-parallel counts
(`parallel`), the LR schedule, the run log and its metrics rows (and the W&B / MLflow trackers that get
them: `tracking`), throughput and the planner's prediction,
gradient diagnostics, the router loss, file modes, and the interface an engine provides (`engine`). The
loop's guards (checkpoints, preemption, the watchdog, the run lock, the resume policy) are
`recipes.reliability`, one floor up. Floor 6: may import numloss, data_prep, recipes.planning,
recipes.parallel_dims, recipes.engines (the contracts), recipes.config and recipes.inputs; never
recipes.reliability."""
