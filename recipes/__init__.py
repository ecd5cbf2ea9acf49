"""Training recipes: YAML files (`configs/`) read into typed dataclasses (`config`), checked before launch
(`checks`, and `validation`: `python -m recipes.validate` with each engine's plan over the cost models of
`planning`), trained by one loop (`train`) on an engine (`engines/`: DeepSpeed, Megatron-core, each behind
one contract, `engines.engine_contract`) from shared parts (`training/`, `inputs/`: tokenizer and model
inputs; `reliability/`: what keeps a run from losing work), scored and reported (`evaluation/`), and the
experiments built on them (`experiments/`: the demo, the studies). Entry points: `python -m
recipes.{train,validate,evaluate,convert,demo,study}`.

Imports point down the floors of docs/architecture.md (tests/test_import_floors.py holds them): planning
and parallel_dims; the engine contracts; config; inputs, training, reliability; the engines' runtime;
checks and evaluation; validation, train, convert, validate, evaluate; experiments; launch on top."""
