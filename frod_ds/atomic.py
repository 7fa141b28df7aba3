"""Writes that readers never see half done: files via ``<name>.tmp`` + fsync + rename, directories built
under a temporary sibling name and renamed into place. Imports nothing heavy (no torch).

The marker rule: every directory frod-ds publishes or creates as a whole holds a marker file
(``MARKER``, written by :func:`building_dir` and :func:`mark_dir`). A command replaces or deletes an existing
directory only if it holds the marker (:func:`check_replaceable`), and never a directory that contains the
current working directory or the repository; anything else is a one-line ``FrodError``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["TMP", "MARKER", "fsync_dir", "atomic_write_text", "atomic_write_json", "building_dir", "publish_dir",
           "mark_dir", "is_marked", "check_replaceable", "remove_marked"]

TMP = ".tmp"
MARKER = ".frod-ds-output"  # present in every directory frod-ds wrote as a whole; proof that it may replace it
_REPO = Path(__file__).resolve().parents[1]
_DISK_ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT, errno.EPERM)


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


def mark_dir(path: Path, kind: str) -> None:
    """Write the marker into directory ``path``: frod-ds wrote it (``kind``: what it is) and may replace it."""
    (path / MARKER).write_text(json.dumps({"format": "frod-ds-output", "kind": kind}) + "\n")


def is_marked(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and (path / MARKER).is_file()


def check_replaceable(out: Path, what: str = "--out") -> None:
    """Raise ``FrodError`` unless an existing ``out`` may be replaced or deleted: a directory (not a link)
    holding the marker (or empty), containing neither the working directory nor the repository."""
    from frod_ds.errors import FrodError

    if not os.path.lexists(out):
        return
    real = Path(os.path.realpath(out))
    for inside in (Path.cwd().resolve(), _REPO):
        if inside == real or real in inside.parents:
            raise FrodError(f"{what} {out} contains {inside}; refusing to replace it, choose a new directory")
    if out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
        return  # an empty directory holds nothing to lose
    if not is_marked(out):
        raise FrodError(f"{what} {out} exists and was not written by frod-ds (no {MARKER} marker); refusing to "
                        "replace it, remove it yourself or choose a new directory")


def remove_marked(out: Path, what: str = "--out") -> None:
    """Delete directory ``out`` if :func:`check_replaceable` allows it (``FrodError`` otherwise)."""
    check_replaceable(out, what)
    if os.path.lexists(out):
        shutil.rmtree(out)


def publish_dir(new: Path, out: Path) -> None:
    """Rename the finished directory ``new`` to ``out``. An existing ``out`` must pass
    :func:`check_replaceable`; it is moved aside first, put back if the rename fails, and deleted after it
    succeeded. The caller decides whether ``out`` may be replaced at all."""
    if not os.path.lexists(out):
        os.rename(new, out)
        return
    check_replaceable(out)
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
def building_dir(out: Path, kind: str = "output") -> Iterator[Path]:
    """A fresh temporary sibling of ``out`` to fill; marked (:func:`mark_dir`) and published as ``out``
    (:func:`publish_dir`) when the block ends normally, deleted when it raises. So ``out`` is either the old
    directory or the complete new one. An existing ``out`` is checked before anything is built."""
    from frod_ds.errors import FrodError

    check_replaceable(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as e:
        raise FrodError(f"cannot create a directory beside {out}: {e.strerror or e}; choose a writable location") from None
    try:
        yield tmp
        mark_dir(tmp, kind)
        publish_dir(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno in _DISK_ERRNOS:
            raise FrodError(f"cannot write {out}: {e.strerror}; free space or choose another location "
                            "(nothing was left behind)") from None
        raise
