"""The parts of the training loop every engine shares: process set-up, batches, data-parallel counts,
the LR schedule, checkpoint directories, the run log. May import numloss, data_prep and recipes.config."""
