"""numloss inside other projects' training loops.

Each integration is its own module and imports its framework only when used, so `import numloss` and
`import numloss.integrations` never import transformers or TRL:

- `numloss.integrations.hf_trainer`: `NumericTrainer` (transformers' `Trainer`) and `NumericSFTTrainer`
  (TRL's `SFTTrainer`) whose loss is the numeric objective with every term divided by the optimizer
  step's global counts, each term logged through the Trainer's own logging.
"""
