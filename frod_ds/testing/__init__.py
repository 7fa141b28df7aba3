"""Tiny local stand-ins for tests and the demo: a toy Llama, a tokenizer, synthetic tasks, a real small model."""
