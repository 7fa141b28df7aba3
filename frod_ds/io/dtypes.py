"""Floating dtypes by name: the one map from the names used in recipes, flags and on-disk records
(``"bfloat16"``) to torch dtypes and safetensors codes (``"BF16"``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from frod_ds.io.hf_checkpoint import safetensors_dtype
from frod_ds.runtime.errors import FrodError

__all__ = ["FLOAT_DTYPES", "ST_CODES", "dtype_name", "dtype_from_name"]

FLOAT_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
# safetensors codes of what frod-ds writes: the float dtypes, and uint8 for quantized blobs (frod_ds.core.quant)
ST_CODES: dict[torch.dtype, str] = {safetensors_dtype(code): code for code in ("F64", "F32", "F16", "BF16", "U8")}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str, allowed: Sequence[str] = tuple(FLOAT_DTYPES), what: str = "dtype") -> torch.dtype:
    """The torch dtype called ``name``; ``FrodError`` naming ``what`` unless it is one of ``allowed``."""
    if name not in allowed or name not in FLOAT_DTYPES:
        raise FrodError(f"{what} must be one of {', '.join(allowed)}, got {name!r}")
    return FLOAT_DTYPES[name]
