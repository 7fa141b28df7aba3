"""The memory planner: per-GPU memory of a set-up from config.json and the DeepSpeed JSON, and the fastest fit."""
