"""The learning-rate schedule both groups (σ, S) follow: linear warmup, then cosine, linear or constant."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from frod_ds.config.recipe import Recipe

__all__ = ["lr_lambda", "lr_scheduler", "group_lrs"]


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """Multiplier of each group's base LR at optimizer step ``s`` (0-based): linear warmup, then decay."""

    def fn(s: int) -> float:
        if warmup_steps > 0 and s < warmup_steps:
            return (s + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = (s - warmup_steps) / max(1, total_steps - warmup_steps)
        progress = min(max(progress, 0.0), 1.0)
        if schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return fn


def lr_scheduler(recipe: Recipe, total_steps: int) -> Callable[[torch.optim.Optimizer], Any]:
    """What ``deepspeed.initialize`` takes as ``lr_scheduler``: a ``LambdaLR`` of ``lr_lambda`` with the recipe's
    schedule, warming up for ``round(train.warmup_ratio * total_steps)`` steps."""
    t = recipe.train
    fn = lr_lambda(t.schedule, int(round(t.warmup_ratio * total_steps)), total_steps)
    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


def group_lrs(optimizer: torch.optim.Optimizer) -> tuple[float, float]:
    """σ's and S's learning rates as the optimizer holds them now: by group name, else the first two groups."""
    groups = optimizer.param_groups
    by_name = {g.get("name"): g["lr"] for g in groups}
    if "sigma" in by_name:
        return by_name["sigma"], by_name.get("s", float("nan"))
    return groups[0]["lr"], groups[1]["lr"]
