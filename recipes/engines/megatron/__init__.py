"""The Megatron-core engine: GPTModel built from HF configs/weights (`model`), its layer spec and fused kernels
(`kernels`), micro-batches as the schedule takes them (`batches`), the step (`step`), HF <-> Megatron conversion
(`convert`), the one-time conversion (`converted`), checkpoints, export, the CPU shim.
May import numloss, data_prep, recipes.config, recipes.training and megatron.core; never recipes.train or planning/evaluation."""
