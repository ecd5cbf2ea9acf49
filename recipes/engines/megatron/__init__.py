"""The Megatron-core engine: GPTModel built from HF configs/weights, HF <-> Megatron conversion, export, the CPU shim.
May import numloss, data_prep, recipes.config, recipes.training and megatron.core; never recipes.train or planning/evaluation."""
