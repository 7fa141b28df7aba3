"""frod-ds: FRoD fine-tuning of LLaMA-family models on DeepSpeed.

The names below load on first use, so that importing a torch-free submodule (``frod_ds.hjd.sharding``,
``frod_ds.io.hf_checkpoint``) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from frod_ds._moved import MOVED, old_paths

__path__ = old_paths(__path__, __name__)  # old module paths, kept for one release (frod_ds._moved)

__all__ = [
    "DEFAULT_TARGETS",
    "FRoDLinear",
    "HJDResult",
    "SparseSupport",
    "apply_frod",
    "decompose",
    "frod_param_groups",
    "mark_only_frod_trainable",
]
__version__ = "0.2.0"

_WHERE = {
    "DEFAULT_TARGETS": "frod_ds.core.names",
    "FRoDLinear": "frod_ds.core.layer",
    "HJDResult": "frod_ds.hjd.math",
    "SparseSupport": "frod_ds.core.layer",
    "apply_frod": "frod_ds.model.apply",
    "decompose": "frod_ds.hjd.math",
    "frod_param_groups": "frod_ds.model.apply",
    "mark_only_frod_trainable": "frod_ds.model.apply",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    if f"frod_ds.{name}" in MOVED:  # ``frod_ds.trainer`` as an attribute, before any import of it
        return importlib.import_module(f"frod_ds.{name}")
    raise AttributeError(f"module 'frod_ds' has no attribute {name!r}")
