"""Small adapters from training frameworks to numloss's vocab-parallel objective.

Each adapter lives in its own module and imports nothing of its framework at import time beyond what
it needs, so `import numloss` (and `import numloss.adapters`) never imports DeepSpeed or Megatron:

- `numloss.adapters.deepspeed_autotp`: DeepSpeed AutoTP with a vocab-parallel lm_head (Hugging Face
  causal LMs): find the TP group and vocab range, compute the objective on split logits, or install
  it as the model's `loss_function`.
- `numloss.adapters.megatron`: `numeric_loss_func`, the last pipeline stage's `loss_func` for
  megatron-core's schedules, normalised over the whole step's counts; and a replacement for
  `GPTModel.compute_language_model_loss` returning per-token losses [b, s] whose masked mean is the
  objective's total (per micro-batch).
"""
