"""Handing a trained adapter to other tools: merged transformers checkpoints (``frod export``), PEFT interop."""
