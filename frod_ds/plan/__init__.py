"""The memory planner: per-GPU memory of a set-up from config.json and the DeepSpeed JSON, and the fastest fit."""

from frod_ds._moved import old_paths

__path__ = old_paths(__path__, __name__)  # old module paths, kept for one release
