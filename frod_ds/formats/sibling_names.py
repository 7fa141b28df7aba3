"""Names frod-ds places beside an output folder (its lease, staging and aside folders), legal however long the
output's own name is; and the one check every output path gets before anything is placed."""

from __future__ import annotations

import hashlib
import os
import socket
import tempfile
from pathlib import Path

__all__ = ["NAME_MAX", "PID_ROOM", "digest_of", "fitted_name", "literal_home", "owned_prefix", "owned_sibling"]

NAME_MAX = 255  # bytes in one file name: the limit of every filesystem frod-ds writes to
PID_ROOM = 16  # what follows an owned sibling's prefix: a pid (at most 7 digits), "-", mkdtemp's 8 random characters


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


def owned_prefix(out: Path, tag: str) -> str:
    """Where the name of a folder that a process of this host makes beside ``out`` starts (``.<name>.<tag>-<host>-``,
    shortened where too long): the process's pid and mkdtemp's random part follow, so a later run of this host can
    tell its maker is gone."""
    return fitted_name(f".{out.name}", f".{tag}-{socket.gethostname()}-", room=PID_ROOM)


def owned_sibling(out: Path, tag: str) -> Path:
    """A new, empty folder beside ``out`` named for this process (:func:`owned_prefix`)."""
    return Path(tempfile.mkdtemp(prefix=f"{owned_prefix(out, tag)}{os.getpid()}-", dir=out.parent))


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
