"""Training engines behind recipes.train: deepspeed/ (HF models under DeepSpeed) and megatron/ (Megatron-core GPTModel)."""
