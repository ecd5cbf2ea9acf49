"""What a recipe can get wrong statically, found before any model is built (`preflight`): settings the
engine would ignore (adopted or refused through the engine's contract: `engine_settings`), the data's
manifest and per-shard statistics against the recipe and the model's config (`data_checks`), the
parallel layout and the model against the engine (`model_checks`, asking the contract), the run directory
and the checkpoint it would resume from (`run_dir_checks`). `recipes.train` runs them on every rank
(exit 2), `recipes.validate` prints them. Floor 8: may import numloss, data_prep, recipes.planning,
recipes.engines (the contracts), recipes.config and recipes.reliability; never an engine's runtime."""
