"""The DeepSpeed engine at run time (floor 7): torch and DeepSpeed."""
