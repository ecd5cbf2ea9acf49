"""Training recipes, evaluation, reports and plots (`recipes.demo` is `make demo`; `recipes.metrics` scores answers)."""
