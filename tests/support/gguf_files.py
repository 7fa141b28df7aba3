"""A small GGUF file written with gguf-py's own writer (two float32 tensors, one block): the input of the tests and
corpus cases of a GGUF cut short."""

from __future__ import annotations

from pathlib import Path


def write_two_tensor_gguf(path: Path, block_count: int = 1) -> bytes:
    """Write the file at ``path`` (its header's ``block_count``: 1, its layers); its bytes."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(block_count)
    w.add_tensor("a", np.arange(64 * 32, dtype=np.float32).reshape(64, 32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones((16,), dtype=np.float32))  # the one block its header names
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()
