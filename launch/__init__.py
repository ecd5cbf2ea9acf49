"""Launchers: Ray orchestration (`launch.ray`), scaling-study sweeps (`launch.sweep`), SLURM batch scripts
(`launch.slurm`). They run `recipes.train.train` and never change what a recipe trains."""
