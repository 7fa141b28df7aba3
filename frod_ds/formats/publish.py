"""Publishing a finished output folder over the one it replaces: the old one moved aside (a folder naming this
host and process, so a later writer can finish a killed one's deletion), the new one renamed into place, and what
the old one's record lists deleted. Torch-free."""

from __future__ import annotations

import contextlib
import errno
import os
import time
from pathlib import Path

from frod_ds.formats.ownership import check_replaceable, delete_owned
from frod_ds.formats.sibling_names import fitted_name, owned_prefix, owned_sibling
from frod_ds.runtime.errors import FrodError, note

__all__ = ["aside_prefix", "finish_aside", "publish_dir"]


def aside_prefix(out: Path) -> str:
    """Where the name of the folder that a process of this host moves the output ``out`` it replaces into starts
    (``.<name>.old-<host>-``); its pid and mkdtemp's random part follow, so a later run can tell it is gone."""
    return owned_prefix(out, "old")


def finish_aside(aside: Path, out: Path, kind: str) -> None:
    """Finish the replacement of ``out`` that a writer killed while deleting the old output left in ``aside``
    (:func:`aside_prefix`): what the old output's record lists is deleted, what appeared in it since is kept
    (:func:`_discard`), and the emptied ``aside`` removed. Left alone while ``out`` is missing (the writer died
    between its two renames: the old output is all there is) and when it holds anything but that output."""
    old = aside / out.name
    with contextlib.suppress(OSError):  # what cannot be read or deleted now stays for the next run to try
        if not os.path.lexists(out) or aside.is_symlink() or any(c.name != out.name for c in os.scandir(aside)):
            return
        if old.is_dir() and not old.is_symlink():
            _discard(old, kind)
        aside.rmdir()


def _discard(old: Path, kind: str) -> None:
    """Delete the replaced output ``old`` (moved aside) but what appeared in it since it was checked: that is
    kept, beside the new output, with a note."""
    if delete_owned(old, kind) and old.exists():
        keep = old.parent.parent / fitted_name(old.name, f".kept-{time.strftime('%Y%m%d-%H%M%S')}")
        os.rename(old, keep)
        note(f"files written into {old.name} while it was replaced are kept in {keep}")


def publish_dir(
    new: Path,
    out: Path,
    kind: str,
    inputs: dict[str, Path | str | None] | None = None,
    error: type[Exception] | None = None,
    what: str = "--out",
) -> None:
    """Rename the finished directory ``new`` to ``out`` (``what``: how the command names it). An existing ``out``
    must pass :func:`check_replaceable` for ``kind``; it is moved aside first, put back if the rename fails, and
    what its record lists deleted after it succeeded. The caller decides whether ``out`` may be replaced at all."""
    if not os.path.lexists(out):
        os.rename(new, out)
        return
    check_replaceable(out, kind, inputs, what=what, error=error)
    aside = owned_sibling(out, "old")
    try:
        os.rename(out, aside / out.name)
    except OSError as e:  # a mount point (EBUSY), a read-only parent: the previous output stays as it was
        aside.rmdir()
        why = "it is a mount point" if e.errno == errno.EBUSY else e.strerror
        raise (error or FrodError)(
            f"cannot replace {out}: it cannot be moved aside ({why}); write to another folder, or remove it yourself"
        ) from None
    try:
        os.rename(new, out)
    except BaseException:
        os.rename(aside / out.name, out)  # put the previous one back
        aside.rmdir()
        raise
    try:
        _discard(aside / out.name, kind)
    except OSError as e:  # the new output is in place: what is left of the old one is named, not an error
        note(
            f"{out} is written, but the output it replaced could not be deleted entirely ({e.strerror}: "
            f"{e.filename}); what is left of it is in {aside}: delete it yourself"
        )
        return
    with contextlib.suppress(OSError):
        aside.rmdir()
