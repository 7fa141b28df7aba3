"""Handing a trained adapter to other tools: merged transformers checkpoints (``frod export``), PEFT interop."""

from frod_ds._moved import old_paths

__path__ = old_paths(__path__, __name__)  # old module paths, kept for one release
