"""A small GGUF file written with gguf-py's own writer (two float32 tensors): the input of the tests and corpus
cases of a GGUF cut short."""

from __future__ import annotations

from pathlib import Path


def write_two_tensor_gguf(path: Path) -> bytes:
    """Write the file at ``path``; its bytes."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tensor("a", np.arange(64 * 32, dtype=np.float32).reshape(64, 32))
    w.add_tensor("b", np.ones((16,), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()
