"""Planning a run before it is launched: `validate` (the recipe, data and layout checks) and `budget`
(memory, disk and communication per GPU). May import numloss, recipes.config, recipes.training and recipes.engines."""
