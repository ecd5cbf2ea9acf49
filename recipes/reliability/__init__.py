"""What keeps a run from losing work when a cluster misbehaves (docs/reliability.md): verified
checkpoints committed by `latest` and a save that fails on every rank together, the resume policy and
the record of every recipe a run used, preemption by signal or file, the watchdog that names a frozen
rank, non-finite values stopping the run, one run per out_dir, and the one Hugging Face export writer
both engines call. Floor 6, above recipes.training: may import numloss, data_prep, recipes.planning,
recipes.engines (the contracts), recipes.config, recipes.inputs and recipes.training."""
