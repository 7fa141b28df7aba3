"""An entry that no file frod-ds writes can be, planted where one of its small files goes (a lease, a manifest, a
config, a record): what the readers must name at once instead of blocking on it, reading it without end or raising."""

from __future__ import annotations

import os
from pathlib import Path

ODD_ENTRIES = ("dangling link", "named pipe", "link to /dev/zero", "folder", "not UTF-8")


def plant(path: Path, kind: str) -> None:
    """``kind`` (one of ``ODD_ENTRIES``) at ``path``."""
    if kind == "dangling link":
        os.symlink(path.parent / "gone", path)
    elif kind == "named pipe":
        os.mkfifo(path)
    elif kind == "link to /dev/zero":
        os.symlink("/dev/zero", path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "not UTF-8":
        path.write_bytes(b'{"format": "\xff\xfe"}')
    else:
        raise ValueError(f"no odd entry {kind!r}: one of {', '.join(ODD_ENTRIES)}")
