"""frod-ds: FRoD fine-tuning of LLaMA-family models on DeepSpeed.

The names below load on first use, so that importing a torch-free submodule (``frod_ds.hjd.plan``,
``frod_ds.hf_checkpoint``) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

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
__version__ = "0.1.0"

_WHERE = {
    "DEFAULT_TARGETS": "frod_ds.hjd.plan",
    "FRoDLinear": "frod_ds.layer",
    "HJDResult": "frod_ds.hjd.math",
    "SparseSupport": "frod_ds.layer",
    "apply_frod": "frod_ds.apply",
    "decompose": "frod_ds.hjd.math",
    "frod_param_groups": "frod_ds.apply",
    "mark_only_frod_trainable": "frod_ds.apply",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'frod_ds' has no attribute {name!r}")
