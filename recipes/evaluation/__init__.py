"""Scoring trained models and reporting runs: `evaluate` (greedy answers), `metrics`, `stats` (intervals),
`report` (tables, curves), `probe` (digit-distribution heatmaps). May import numloss, data_prep, recipes.training."""
