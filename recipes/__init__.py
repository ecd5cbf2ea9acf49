"""Training recipes, evaluation, reports and plots. For now: `recipes.demo` (make demo) and `recipes.metrics`."""
