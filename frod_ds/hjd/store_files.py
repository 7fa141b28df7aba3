"""A factor store's folder as files on disk, on rank 0: which of them HJD may delete (those its ownership record
lists), the aside that keeps a store ``--overwrite`` replaces until the new one is built, and the stamps that
let a later run tell a user's edit of a complete store (its factor files carry checksums in the manifest; the
manifest and ``V`` files are stamped in its record once the store is complete, the stamps dropped before HJD
writes into it again)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from frod_ds.formats.factor_store import MANIFEST, Manifest, is_store_file
from frod_ds.formats.output_dir import MARKER, edited_since_written, entries_of, match, read_record
from frod_ds.formats.ownership import delete_owned, edit_stamps, is_marked, stamp_listed
from frod_ds.formats.sibling_names import fitted_name
from frod_ds.runtime.atomic import TMP
from frod_ds.runtime.errors import HJDError, StoreError, note
from frod_ds.runtime.paths import unmovable

__all__ = [
    "KIND",
    "aside_problem",
    "discard_unfinished",
    "drop_aside",
    "refuse_edited",
    "remove_store_files",
    "restore_aside",
    "set_aside",
    "stamp_complete",
    "unstamp",
]

KIND = "factor-store"  # the ownership record's kind (frod_ds.formats.output_dir)


def remove_store_files(out: Path, category: str | None = None) -> None:
    """Delete the factor files (and temporaries) of ``category``, or of every category and the manifest: those
    the store's ownership record lists, never a file of that name it did not write."""
    entries = entries_of(read_record(out), KIND) or ()
    for p in out.iterdir():
        if is_store_file(p.name, category) or (category is None and p.name in (MANIFEST, MANIFEST + TMP)):
            if match(entries, p.name, p.is_dir()) == "own":
                p.unlink()


def _aside(out: Path) -> Path:
    """``.NAME.replaced`` beside ``out``, shortened where ``out``'s name is near the file system's limit."""
    return out.parent / fitted_name(f".{out.name}", ".replaced")


ASIDE_STAMP = ".frod-ds-aside"  # in the aside: which store it holds the files of (written before any file moves)


def _stamp_of(out: Path) -> str:
    return json.dumps({"aside_of": str(out.resolve())}) + "\n"


def _ours(out: Path) -> bool:
    """Whether ``out``'s aside name holds the aside ``set_aside`` made for ``out``: a real folder (no link) with a
    factor store's ownership record and the stamp naming ``out``. None other is trusted: a user's folder of that
    name (a copy of a store too) is never emptied, filled or deleted."""
    aside = _aside(out)
    if aside.is_symlink() or not aside.is_dir():
        return False
    record = read_record(aside)
    if record is None or record.kind != KIND or entries_of(record, KIND) is None:
        return False
    stamp = aside / ASIDE_STAMP
    try:
        return not stamp.is_symlink() and stamp.is_file() and stamp.read_text() == _stamp_of(out)
    except (OSError, UnicodeDecodeError):
        return False


def aside_problem(out: Path) -> str | None:
    """What is at ``out``'s aside name when it is no aside of a store (``_ours``), in one line; None otherwise."""
    aside = _aside(out)
    if not os.path.lexists(aside) or _ours(out):
        return None
    what = (
        f"a symbolic link (to {os.readlink(aside)})"
        if aside.is_symlink()
        else "a folder frod-ds did not write (no factor store record)"
        if aside.is_dir() and read_record(aside) is None
        else "a folder not set aside for this store (another store, or a copy)"
        if aside.is_dir()
        else "a file"
    )
    return (
        f"--out {out} --overwrite keeps the store it replaces in {aside} until the new one is built, and {what} is "
        "there: move it away and run the same command again"
    )


def set_aside(out: Path) -> None:
    """``--overwrite`` of a store: its files move into a hidden sibling (``.NAME.replaced``) until the new store is
    complete, so a build that fails gives the old one back (``restore_aside``); one that succeeds drops it
    (``drop_aside``). If the sibling is there already (a replacement killed earlier), ``out`` holds that build's
    partial files, which go, and the sibling keeps the store being replaced. Rank 0, before any factor is written."""
    aside = _aside(out)
    problem = aside_problem(out)
    if problem:
        raise HJDError(problem)
    if os.path.lexists(aside):  # ours (aside_problem): a replacement killed earlier
        remove_store_files(out)
        return
    entries = entries_of(read_record(out), KIND) or ()
    stuck = unmovable([out, *out.iterdir()], out.parent)
    if stuck is not None:
        raise HJDError(
            f"--out {out} --overwrite moves the store it replaces aside into {aside} until the new one is built, and "
            f"{stuck} is a mount point (or on another file system); remove the store's files yourself, or choose "
            "another --out (nothing was moved)"
        )
    aside.mkdir()
    (aside / ASIDE_STAMP).write_text(_stamp_of(out))  # first: an aside a kill left is known by them (_ours)
    shutil.copy2(out / MARKER, aside / MARKER)
    for f in list(out.iterdir()):
        if f.name != MARKER and match(entries, f.name, f.is_dir()) == "own":
            f.rename(aside / f.name)


def restore_aside(out: Path) -> None:
    """Rank 0, after a replacement build refused its input: its files go, the store it replaced comes back."""
    aside = _aside(out)
    if not _ours(out):
        return
    remove_store_files(out)
    (aside / ASIDE_STAMP).unlink()
    for f in list(aside.iterdir()):
        f.replace(out / f.name)
    aside.rmdir()
    note(f"--out {out}: the new store was not built; the store it was to replace is back")


def drop_aside(out: Path) -> None:
    """Rank 0, once the new store is built: the replaced one goes (what its record lists)."""
    if _ours(out):
        (_aside(out) / ASIDE_STAMP).unlink()
        delete_owned(_aside(out), KIND)


def discard_unfinished(out: Path, manifest: Manifest, existed: bool) -> None:
    """Rank 0, after the run refused its input (NaN weights, a failed probe): a store this run created is removed
    whole (nothing partial is left); of one that was there before, the files of every category not complete (its
    complete ones stay, to resume once the checkpoint is fixed). A killed run is not refused: it stays resumable."""
    if not out.is_dir():
        return
    if not existed:
        shutil.rmtree(out, ignore_errors=True)
        return
    for c in manifest.categories:
        if c not in manifest.completed_categories:
            remove_store_files(out, c)
    if not manifest.completed_categories:
        remove_store_files(out)
        (out / MARKER).unlink(missing_ok=True)


def refuse_edited(out: Path, replacing: bool) -> None:
    """Rank 0, before HJD writes into an existing store: ``HJDError`` naming the files changed since HJD wrote
    them (a user's): those the complete store's record stamps and, when ``replacing`` it, factor files whose bytes
    are not those its manifest records. Reads only."""
    edited = edited_since_written(out, read_record(out) if is_marked(out) else None)
    if replacing:
        try:
            edited += [f for f in Manifest.read(out / MANIFEST).edited_files(out) if f not in edited]
        except StoreError:
            pass  # an unreadable manifest records nothing to compare; the store's record decides what goes
    if edited:
        shown = ", ".join(edited[:5]) + (f" and {len(edited) - 5} more" if len(edited) > 5 else "")
        raise HJDError(
            f"--out {out} holds files changed since frod hjd wrote them: {shown}; refusing to write over them, "
            "move them out or choose another --out"
        )


def unstamp(out: Path) -> None:
    """Rank 0, just before HJD writes the manifest of a store again: the stamps of the complete store go (a run
    killed from here leaves it unstamped, as an unfinished store is); :func:`stamp_complete` stamps it anew."""
    edit_stamps(out, lambda written: None)


def stamp_complete(out: Path) -> None:
    """Rank 0, once the store is complete: its record stamps the files it names (``manifest.json`` and each
    category's ``V``; the parts' names are patterns, their checksums are the manifest's), so a later run can tell
    a user's edit (:func:`refuse_edited`). A store stamped already is left as it is."""
    if is_marked(out):
        stamp_listed(out, KIND)
