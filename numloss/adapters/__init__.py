"""Small adapters from training frameworks to numloss's vocab-parallel objective.

Each adapter lives in its own module and imports nothing of its framework at import time beyond what
it needs, so `import numloss` (and `import numloss.adapters`) never imports DeepSpeed or Megatron:

- `numloss.adapters.hf`: a Hugging Face causal LM whose forward returns the objective (logits or the
  chunked head): `NumericCausalLM(model, objective)`, or under DeepSpeed AutoTP the HF model itself,
  `numeric_autotp_model(model, objective)`. What `recipes.train` trains on DeepSpeed.
- `numloss.adapters.deepspeed_autotp`: DeepSpeed AutoTP with a vocab-parallel lm_head: find the TP
  group and vocab range (`find_vocab_shard`) and compute the objective on split logits
  (`causal_lm_objective`); `numloss.adapters.hf` calls them.
- `numloss.adapters.megatron`: `numeric_loss_func`, the last pipeline stage's `loss_func` for
  megatron-core's schedules, normalised over the whole step's counts. What `recipes.train` trains on
  Megatron-core.
"""
