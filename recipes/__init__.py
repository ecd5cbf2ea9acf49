"""Training recipes: YAML files (`configs/`) read into typed dataclasses (`config`), trained by one loop
(`train`) on an engine (`engines/`: DeepSpeed, Megatron-core) from shared parts (`training/`, and
`inputs/`: tokenizer and model inputs), checked
before launch (`planning/`), scored and reported (`evaluation/`), and the experiments built on them
(`experiments/`: the demo, the studies). Entry points: `python -m recipes.{train,validate,evaluate,demo,study}`.
Imports point down: train -> engines -> training -> inputs -> config; planning -> engines; experiments -> everything."""
