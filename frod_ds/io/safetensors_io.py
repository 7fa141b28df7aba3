"""safetensors files written straight from tensor memory (no serialized copy), with their CRC-32.

``safetensors_header`` lays out a file before any byte is written (the HJD stage's part files are then
filled at known offsets by several threads); ``save_tensors_atomic`` writes a whole file under
its temporary (``runtime.atomic.TMP``) and renames it. Both give what ``safetensors.safe_open`` reads.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from frod_ds.io.dtypes import ST_CODES
from frod_ds.runtime.atomic import open_tmp, replacing

__all__ = ["safetensors_header", "save_tensors_atomic", "tensor_bytes"]


def tensor_bytes(t: Tensor) -> Tensor:
    """A flat ``uint8`` view of a tensor's data (contiguous copy first if needed)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def safetensors_header(entries: Sequence[tuple[str, torch.dtype, Sequence[int]]]) -> tuple[bytes, dict[str, int]]:
    """The leading bytes of a safetensors file holding ``entries`` (name, dtype, shape) in this order:
    8-byte length + JSON header, padded so the data starts 8-byte aligned. Also returns each tensor's
    offset from the start of the file."""
    header: dict[str, Any] = {}
    offset = 0
    for name, dtype, shape in entries:
        assert dtype in ST_CODES, f"{name}: float or uint8 dtype expected, got {dtype}"
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        header[name] = {"dtype": ST_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    start = 8 + len(raw)
    offsets = {name: start + header[name]["data_offsets"][0] for name, _, _ in entries}
    return len(raw).to_bytes(8, "little") + raw, offsets


def save_tensors_atomic(path: Path, tensors: dict[str, Tensor], fsync: bool = True) -> int:
    """Write a safetensors file under its temporary and rename it (CPU tensors, float dtypes); returns the
    file's CRC-32, taken as the bytes are written.

    The writes release the GIL, so a background writer thread overlaps with GPU work.
    """
    for name, t in tensors.items():
        assert t.device.type == "cpu", f"{name}: CPU tensor expected"
    head, _ = safetensors_header([(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()])
    crc = zlib.crc32(head)
    with replacing(path) as tmp:
        with open(open_tmp(tmp), "wb") as f:
            f.write(head)
            for t in tensors.values():
                if t.numel():
                    data = memoryview(tensor_bytes(t).numpy())
                    crc = zlib.crc32(data, crc)
                    f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    return crc
