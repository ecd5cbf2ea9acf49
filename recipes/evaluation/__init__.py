"""Scoring trained models and reporting runs: `evaluate` (greedy answers over an export), its backends
(`generation`: Hugging Face `generate`, `vllm_generation`: vLLM; `data_parallel`: rows shared over
torchrun ranks; `placement`: how many GPUs an export needs), `harness` (lm-evaluation-harness),
`metrics`, `stats` (intervals), `report` (tables, curves), `probe` (digit-distribution heatmaps).
Floor 8: may import numloss, data_prep, recipes.config and recipes.inputs (and any floor below 8);
never recipes.train, recipes.validation or the experiments."""
