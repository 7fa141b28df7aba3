"""frod-ds: FRoD fine-tuning of LLaMA-family models on DeepSpeed."""

from frod_ds.apply import DEFAULT_TARGETS, apply_frod, frod_param_groups, mark_only_frod_trainable
from frod_ds.hjd import HJDResult, decompose
from frod_ds.layer import FRoDLinear, SparseSupport

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
