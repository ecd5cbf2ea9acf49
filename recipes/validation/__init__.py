"""Checking a recipe before it is launched: `python -m recipes.validate` (`validate`: loading, the model's
config and size, the static checks of `recipes.checks`, the engine's plan through its contract, the
data), the report it prints (`report.Report`; each engine's own lines come from its contract's `report`)
and the one recommender (`recommend`: the fastest layout on any engine). May import every floor below it: numloss, data_prep, recipes.planning,
recipes.parallel_dims, recipes.engines (the contracts and their plans), recipes.config, recipes.checks."""
