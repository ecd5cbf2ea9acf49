"""The parts of the training loop every engine shares: process set-up, data-parallel counts, the LR
schedule, the run log, throughput and gradient diagnostics, the engine interface. The loop's guards
(checkpoints, preemption, the watchdog, the run lock, the resume policy) are `recipes.reliability`.
May import numloss, data_prep, recipes.config and recipes.inputs."""
