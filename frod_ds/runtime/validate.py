"""The checks of the method's own settings, defined once: π, the density of S, the targets, a category's
input width. Each returns the problem as a line (``None`` when fine), so that callers collecting every
problem (the recipe, the HJD options) and callers raising at the first one share the wording."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["pi_problem", "sparsity_problem", "targets_problem", "widths_problem", "device_problem"]


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def pi_problem(pi: Any, name: str = "pi") -> str | None:
    """π, the ridge term of ``T_pi`` (spec §1), must be a finite number > 0."""
    if _number(pi) and math.isfinite(pi) and pi > 0:
        return None
    return f"{name} must be a finite number > 0 (the ridge term of T_pi), got {pi!r}"


def sparsity_problem(sparsity: Any, name: str = "sparsity") -> str | None:
    """The density of ``S`` (the recipe's ``model.sparsity``, 2% in the paper) must be in (0, 1)."""
    if _number(sparsity) and 0 < sparsity < 1:
        return None
    return f"{name} must be in (0, 1), got {sparsity!r}"


def targets_problem(targets: Any, name: str = "targets") -> str | None:
    """Targets name modules by their last path component: at least one, distinct, without dots."""
    if isinstance(targets, str) or not isinstance(targets, Sequence) or not targets:
        return f"{name} must be a non-empty list of module names, got {targets!r}"
    if len(set(targets)) != len(targets) or any(not isinstance(t, str) or not t or "." in t for t in targets):
        return f"{name} must be distinct module names without dots, got {list(targets)}"
    return None


def widths_problem(widths: Iterable[int], what: str = "the category") -> str | None:
    """All members of a category share the input width ``n`` (one ``V`` of shape (n, n))."""
    widths = sorted(set(widths))
    if len(widths) > 1:
        return (
            f"{what} mixes input widths {widths}; members of one category must share the input width n "
            "(split them into separate categories)"
        )
    return None


def device_problem(device: Any, name: str = "--device") -> str | None:
    """A torch device this process can use: parseable, and a CUDA one only when that GPU is visible (torch
    otherwise fails deep inside the first copy with an assertion). Imports torch."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        return f"{name} {device!r} is not a device; use cpu or cuda (cuda:N for the N-th GPU)"
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        return f"{name} {device!r} is not supported here; use cpu or cuda"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return f"{name} {device} but no CUDA device is visible to this process; use --device cpu"
    if dev.index is not None and dev.index >= count:
        return f"{name} {device} but only {count} CUDA device(s) are visible (cuda:0..cuda:{count - 1})"
    return None
