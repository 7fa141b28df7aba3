"""Training: data batches, the trainable state, sealed checkpoints, the DeepSpeed engine's checkpoint, the loop."""
