"""Torch pickles (engine checkpoint files) loaded without running what a foreign file holds.

``torch.load(..., weights_only=False)`` runs whatever callable a pickle names. Every ``.pt`` file of a checkpoint
(DeepSpeed's engine files, ``rng_rank<r>.pt``) is loaded with ``weights_only=True`` and an allow-list of the few
DeepSpeed classes its engine files hold (``ENGINE_GLOBALS``); a file naming anything else is refused with the
name. ``use_safe_loads`` makes a DeepSpeed engine load its own files the same way.
"""

from __future__ import annotations

import importlib
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

from frod_ds.runtime.errors import FrodError

__all__ = ["ENGINE_GLOBALS", "UnsafePickleError", "engine_globals", "safe_load", "unloadable", "use_safe_loads"]

# What DeepSpeed 0.19's engine files pickle besides tensors and builtins (the committed fixtures' files name only
# these, tests/repo/test_moved_paths.py): plain records, no behaviour when rebuilt.
ENGINE_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
_GLOBAL = re.compile(r"[Uu]nsupported (?:global: )?GLOBAL (\S+)")  # as torch 2.x words it


class UnsafePickleError(FrodError):
    """A checkpoint file names a class or function frod-ds never writes: it is not loaded."""

    def __init__(self, message: str, named: str) -> None:
        super().__init__(message)
        self.named = named  # what the file names ("os.system"), or "an object" when torch does not say


def engine_globals() -> list[Any]:
    """The classes of ``ENGINE_GLOBALS`` that this DeepSpeed has (a newer one may have moved one)."""
    found = []
    for dotted in ENGINE_GLOBALS:
        module, _, name = dotted.rpartition(".")
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return found


def safe_load(path: str | Path, map_location: Any = None, mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` with ``ENGINE_GLOBALS`` allowed; ``UnsafePickleError`` naming the
    file and what it names when it holds anything else (nothing of it is run)."""
    try:
        with torch.serialization.safe_globals(engine_globals()):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        hit = _GLOBAL.search(str(e))
        named = hit.group(1) if hit else "an object"
        raise UnsafePickleError(
            f"{path} names {named}, which no frod-ds checkpoint holds; it is not loaded (a checkpoint from "
            "elsewhere, or damaged): resume from a checkpoint this run wrote, or pass train.new_run=true",
            named,
        ) from None


def unloadable(path: Path) -> str | None:
    """Why ``path`` cannot be loaded by :func:`safe_load` (its tensors memory-mapped, not read), or None."""
    try:
        safe_load(path, map_location="cpu", mmap=zipfile.is_zipfile(path))
    except UnsafePickleError as e:
        return f"{path.name} names {e.named}, which frod-ds never writes (not loaded)"
    except Exception as e:  # noqa: BLE001 - any failure to read means the file cannot be resumed from
        return f"{path.name} cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    return None


def use_safe_loads(engine: Any) -> None:
    """Make ``engine`` (a DeepSpeed engine) read its checkpoint files with :func:`safe_load`: DeepSpeed's torch
    checkpoint engine loads them with ``weights_only=False``."""
    engine.checkpoint_engine.load = lambda path, map_location=None: safe_load(path, map_location)
