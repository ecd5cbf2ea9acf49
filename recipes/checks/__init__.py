"""What a recipe can get wrong statically, found before any model is built (`preflight`): settings the
engine would ignore, the data's manifest and per-shard statistics against the recipe and the model's
config, the parallel layout against the model's shape, the run directory. `recipes.train` runs them on
every rank (exit 2), `recipes.validate` prints them. May import numloss, data_prep, recipes.config and
recipes.engines (the engines' own rules: which checkpoints load at which layout)."""
