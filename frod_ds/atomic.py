"""Writes that readers never see half done: files via ``<name>.tmp`` + fsync + rename, directories built
under a temporary sibling name and renamed into place. Imports nothing heavy (no torch)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["TMP", "fsync_dir", "atomic_write_text", "atomic_write_json", "building_dir", "publish_dir"]

TMP = ".tmp"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``path`` via ``path.tmp`` + fsync + rename: readers see the old or the new file, never half."""
    tmp = path.with_name(path.name + TMP)
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    """:func:`atomic_write_text` of ``obj`` as indented JSON."""
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=False) + "\n")


def publish_dir(new: Path, out: Path) -> None:
    """Rename the finished directory ``new`` to ``out``. An existing ``out`` is moved aside first, put back
    if the rename fails, and deleted after it succeeded. The caller decides whether ``out`` may be replaced."""
    if not out.exists():
        os.rename(new, out)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.rename(out, aside / out.name)
    try:
        os.rename(new, out)
    except BaseException:
        os.rename(aside / out.name, out)  # put the previous one back
        shutil.rmtree(aside, ignore_errors=True)
        raise
    shutil.rmtree(aside, ignore_errors=True)


@contextlib.contextmanager
def building_dir(out: Path) -> Iterator[Path]:
    """A fresh temporary sibling of ``out`` to fill; published as ``out`` (:func:`publish_dir`) when the block
    ends normally, deleted when it raises. So ``out`` is either the old directory or the complete new one."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
