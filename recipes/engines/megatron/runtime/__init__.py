"""The Megatron-core engine at run time (floor 7): torch and megatron-core."""
