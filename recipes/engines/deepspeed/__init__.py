"""The DeepSpeed engine: Hugging Face models under ZeRO 0-3 and AutoTP, their DeepSpeed config,
checkpoints and sharded export. May import numloss, data_prep, recipes.config and recipes.training."""
