"""User mistakes are ``FrodError``s; anything else is a bug.

A ``FrodError`` says in one line what is wrong and what to do about it; the launch scripts print it as one
``error: ...`` line and exit with status 2 (``frod_ds.runtime.entry``). Every other exception is a bug: it keeps its
traceback and the process exits non-zero. Each stage has its own subclass (``RecipeError``, ``DataError``,
``EvalError``, ``DataPrepError``, ... beside the code that raises them; the shared ones below).

``FrodError`` subclasses ``ValueError`` so that callers written against "bad input raises ValueError" keep
working; nothing in frod-ds catches ``ValueError`` to mean a user error. Imports nothing heavy (no torch).
"""

from __future__ import annotations

import os
import sys

__all__ = [
    "USER_ERROR",
    "FrodError",
    "CheckpointError",
    "StoreError",
    "AdapterError",
    "HJDError",
    "ExportError",
    "note",
]

USER_ERROR = 2  # exit status of a user mistake (a FrodError's, a console stream lost)


class FrodError(ValueError):
    """A user mistake; the message is one line naming what is wrong and what to change."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).splitlines()))


class CheckpointError(FrodError):
    """A base-model checkpoint that cannot be read (missing directory, shard, truncated file)."""


class StoreError(FrodError):
    """A factor store that cannot be used: missing, incomplete, corrupt, or not the one asked for."""


class AdapterError(FrodError):
    """An adapter checkpoint that cannot be used: missing, malformed, or not of this factor store."""


class HJDError(FrodError):
    """Bad input to the HJD stage or the HJD math (options, weights)."""


class ExportError(FrodError):
    """Bad input to the export of an adapter."""


_noted: set[str] = set()


def note(message: str) -> None:
    """Print ``note: message`` once per process, on rank 0 only (no torch import: ``RANK`` from the
    launcher's environment)."""
    if message in _noted or os.environ.get("RANK", "0") != "0":
        return
    _noted.add(message)
    print(f"note: {' '.join(message.splitlines())}", file=sys.stderr, flush=True)


_completed: list[str] = []  # the command's outputs published whole, newest last (entry's stop line names one)


def completed(output: str) -> None:
    """Record that the command's own output ``output`` (its flag and path) is published whole: a stop arriving
    after it says so instead of promising a re-run."""
    _completed.append(output)


def last_completed() -> str | None:
    return _completed[-1] if _completed else None


def forget_notes() -> None:
    """Let every note print again and forget the completed outputs: the end of a command
    (``entry.run_script``), so a caller that runs several commands in one process sees each command's own."""
    _noted.clear()
    _completed.clear()
