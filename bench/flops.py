"""Model FLOPs per training token (FRoD, LoRA) and bf16 peaks: the planner's own counter, ``frod_ds.plan.flops``
(one home: the step-time model and the benchmarks' MFU use the same count)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from frod_ds.plan.flops import (  # noqa: E402
    PEAK_BF16,
    TARGET_SHAPES,
    flops_per_token,
    frod_target_macs,
    linear_shapes,
    lora_target_macs,
    peak_bf16_flops,
)

__all__ = [
    "PEAK_BF16",
    "TARGET_SHAPES",
    "flops_per_token",
    "frod_target_macs",
    "linear_shapes",
    "lora_target_macs",
    "peak_bf16_flops",
]
