"""Tiny local stand-ins for tests and the demo: a toy Llama, a tokenizer, synthetic tasks."""

from frod_ds._moved import old_paths

__path__ = old_paths(__path__, __name__)  # old module paths, kept for one release
