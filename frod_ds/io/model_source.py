"""What a model argument that is no local directory means, in one line, for the commands that hand it to
transformers as it is (``eval --model``): transformers would read it as a Hugging Face Hub id and answer with the
Hub's words (a repo id format, no connection) where the user mistyped a folder.

A path that can only be local (absolute, starting with ``./``, ``../`` or ``~``, or with more than one ``/``) is
refused before transformers sees it; one that could be a Hub id (``org/name``, ``name``) is still loaded from the
Hub, and when that fails the line gives both readings.
"""

from __future__ import annotations

import os
from pathlib import Path

from frod_ds.runtime.paths import dir_problem, expand_home

__all__ = ["hub_load_failure", "is_local_only", "missing_model_dir"]

PASS = "pass a local model directory (config.json + *.safetensors) or a Hugging Face Hub id (org/name)"


def is_local_only(model: str) -> bool:
    """True when ``model`` cannot be a Hub id (``name`` or ``org/name``), so it names a local folder."""
    return model.startswith((".", "/", "~")) or model.count("/") > 1


def missing_model_dir(model: str, flag: str = "--model") -> str | None:
    """One line when ``model`` is no directory and is either something else on disk (a broken link, a pipe) or
    a path that can only be local; None for a directory or what could be a Hub id."""
    path = expand_home(model)
    if path.is_dir():
        return None
    if os.path.lexists(path):
        return f"{flag} {dir_problem(path)}; {PASS}"
    if is_local_only(model):
        return f"{flag} {model}: no such folder; {PASS}"
    return None


def hub_load_failure(model: str, exc: BaseException, flag: str = "--model") -> str:
    """One line for a ``model`` that is no local directory and that transformers could not load as a Hub id
    either (offline, not in the cache, no such repo): both readings, and transformers' first line."""
    lines = str(exc).strip().splitlines()
    reason = lines[0][:200].rstrip(". ") if lines else type(exc).__name__
    return (
        f"{flag} {model}: no local folder {model} (relative to {Path.cwd()}), and the Hub repo {model!r} could not "
        f"be loaded: {reason}; {PASS}"
    )
