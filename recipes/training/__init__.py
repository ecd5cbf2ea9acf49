"""The parts of the training loop every engine shares: process set-up, data-parallel counts, the LR
schedule, checkpoint directories, the run log and throughput, and the trainer's guards (non-finite values,
preemption, the run lock). May import numloss, data_prep, recipes.config and recipes.inputs."""
