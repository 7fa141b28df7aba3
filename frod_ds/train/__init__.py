"""Training: data batches, the trainable state, sealed checkpoints, the DeepSpeed engine's checkpoint, the loop."""

from frod_ds._moved import old_paths

__path__ = old_paths(__path__, __name__)  # old module paths, kept for one release
