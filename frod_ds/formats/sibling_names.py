"""Names frod-ds places beside an output folder (its lease, staging and aside folders), legal however long the
output's own name is; and the one check every output path gets before anything is placed."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

__all__ = ["NAME_MAX", "digest_of", "fitted_name", "literal_home"]

NAME_MAX = 255  # bytes in one file name: the limit of every filesystem frod-ds writes to


def fitted_name(stem: str, suffix: str, room: int = 0) -> str:
    """``stem + suffix``; where that, with ``room`` bytes more, would pass ``NAME_MAX``, ``stem`` cut short and
    followed by ``~`` and a digest of all of it, then ``suffix``. Depends on the names only, so every writer of an
    output derives the same name beside it (its lease, its staging folders), legal however long the output's is."""
    if len(os.fsencode(stem + suffix)) + room <= NAME_MAX:
        return stem + suffix
    digest = digest_of(stem)
    budget = NAME_MAX - room - len(os.fsencode(suffix)) - len(digest) - 1
    head = stem
    while len(os.fsencode(head)) > budget:
        head = head[:-1]
    return f"{head}~{digest}{suffix}"


def digest_of(stem: str) -> str:
    """What follows ``~`` in a shortened name (``fitted_name``): 16 hex digits of ``stem``'s SHA-256, so that a
    reader can tell a shortened name of one output from any other's (``output_dir.match``)."""
    return hashlib.sha256(os.fsencode(stem)).hexdigest()[:16]


def literal_home(out: Path, what: str) -> str | None:
    """Why output ``out`` is refused when its first part starts with ``~``: frod-ds takes it literally (a folder of
    that name in the working directory), which is never what was meant when no shell expanded it (a quoted
    argument, a recipe). None for any other path."""
    if not (out.parts and out.parts[0].startswith("~")):
        return None
    return (
        f"{what} {out} starts with {out.parts[0]!r}, which frod-ds takes literally (a folder of that name here), not "
        f"as a home folder: no shell expanded it; write the path out ({os.path.expanduser(out)}), or "
        f"{os.path.abspath(out)} for a folder really named so"
    )
