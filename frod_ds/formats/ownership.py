"""Who owns a folder: the rules behind every output frod-ds writes, replaces or deletes (docs/failure-policy.md).

Every folder frod-ds writes holds its ownership record (``frod_ds.formats.output_dir``: its kind and what the
writer wrote, each entry recorded before the file is made). A command replaces or deletes only what that record
lists, and only in a folder of its own kind (:func:`check_replaceable`) that holds nothing else, is none of its
inputs, the working directory or the repository; otherwise one line lists what is in the way, before anything is
written. A folder published as a whole is built in a temporary sibling and renamed into place
(:func:`building_dir`); :func:`remove_owned` is ``--overwrite``'s deletion. Imports nothing heavy (no torch).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from frod_ds.formats.lease import live_holder
from frod_ds.formats.output_dir import (
    FORMAT,
    KIND_FILES,
    KINDS,
    MARKER,
    VERSION,
    OutputRecord,
    edited_since_written,
    entries_of,
    is_lease_file,
    is_marked,
    listed_dir,
    listed_since_written,
    match,
    read_record,
    record_text,
    stamps_of,
)
from frod_ds.formats.record_check import broken_record, record_problem
from frod_ds.formats.tree_stamps import tree_added
from frod_ds.runtime.atomic import atomic_write_text
from frod_ds.runtime.errors import FrodError

__all__ = [
    "MARKER",
    "KINDS",
    "mark_dir",
    "edit_stamps",
    "restamp",
    "stamp_listed",
    "record_files",
    "is_marked",
    "marker_kind",
    "inventory",
    "foreign_files",
    "check_not_an_input",
    "check_replaceable",
    "check_out",
    "remove_owned",
    "delete_owned",
]

_REPO = Path(__file__).resolve().parents[1]
SHOWN = 6  # foreign paths a refusal names before "and N more"


def marker_kind(path: Path) -> str | None:
    """The kind the record of folder ``path`` names; None without a readable one."""
    record = read_record(Path(path))
    return record.kind if record is not None else None


def mark_dir(path: Path, kind: str, files: Iterable[str] = (), stamp: bool = False) -> None:
    """Write a new ownership record into folder ``path``: written by frod-ds as ``kind``, holding ``files``;
    ``stamp``: a finished write-once output, whose files' sizes, mtimes and digests are recorded too."""
    assert kind in KINDS, f"unknown output kind {kind!r}; add it to frod_ds.formats.output_dir.KINDS"
    files = sorted(set(files))
    written = stamps_of(Path(path), files) if stamp else None
    record = OutputRecord(format=FORMAT, kind=kind, version=VERSION, files=files, written=written)
    atomic_write_text(Path(path) / MARKER, record_text(record))


def stamp_listed(path: Path, kind: str | None = None) -> None:
    """Stamp the files the record of folder ``path`` names, unless it stamps them already: an output written in
    place, now complete (a factor store), or one a write-once output publishes inside it. ``kind``: only a record
    of that kind. Lease holder only."""
    record = read_record(Path(path))
    if record is not None and record.kind is not None and record.written is None and kind in (None, record.kind):
        mark_dir(Path(path), record.kind, record.files or (), stamp=True)


def edit_stamps(path: Path, edit: Callable[[dict[str, list]], dict[str, list] | None]) -> None:
    """Rewrite the stamps of the record of folder ``path`` as ``edit`` returns them (None: none), when it has some.
    Lease holder only."""
    record = read_record(Path(path)) if is_marked(Path(path)) else None
    if record is not None and record.written is not None:
        record.written = edit(record.written)
        atomic_write_text(Path(path) / MARKER, record_text(record))


def restamp(path: Path, entries: Iterable[str]) -> None:
    """After the writer replaced ``entries`` of a write-once output in place (an eval into its earlier results), its
    record's stamps of them are the new files' (else the next run reads them as a user's edit). Lease holder only."""
    edit_stamps(path, lambda written: {**written, **stamps_of(Path(path), list(entries))})


def record_files(path: Path, entries: Iterable[str], kind: str | None = None) -> None:
    """Add ``entries`` to the record of folder ``path`` before the writer makes them (a record from before file
    lists takes its kind's list first; a folder without a record gets one of ``kind``). Only the lease holder
    writes a record, so this read-modify-write races no one."""
    path = Path(path)
    entries = list(entries)
    record = read_record(path)
    if record is None or record.kind is None:
        assert kind is not None, f"{path} has no ownership record to add {list(entries)} to"
        older = path.is_dir() and any(c.name != MARKER for c in os.scandir(path))  # written before records
        mark_dir(path, kind, [*(KIND_FILES[kind] if older else ()), *entries])
        return
    have = list(entries_of(record) or ())
    new = [e for e in entries if e not in have]
    if new or record.files is None:
        record.files, record.version = sorted({*have, *new}), VERSION
        atomic_write_text(path / MARKER, record_text(record))


def inventory(folder: Path) -> list[str]:
    """What a writer built in ``folder`` (its whole content), as record entries: every file; ``sub/`` for a folder
    with a record of its own (its record lists its content) and for an empty folder."""
    out = []
    for root, dirs, files in os.walk(folder):
        rel = Path(root).relative_to(folder).as_posix()
        prefix = "" if rel == "." else rel + "/"
        if prefix and not dirs and not files:
            out.append(prefix)
        for d in list(dirs):
            if listed_dir(Path(root, d)) or os.path.islink(Path(root, d)):
                out.append(prefix + d + ("" if os.path.islink(Path(root, d)) else "/"))
                dirs.remove(d)
        out += [prefix + f for f in files if prefix or f != MARKER]
    return sorted(out)


@dataclass
class _Scan:
    """A folder sorted by who wrote what (paths absolute; ``foreign`` relative to the folder, for messages)."""

    own: list[Path] = field(default_factory=list)  # files and whole directories the writer wrote
    dirs: list[Path] = field(default_factory=list)  # directories holding listed paths, nested outputs' folders
    foreign: list[str] = field(default_factory=list)
    leases: list[Path] = field(default_factory=list)
    nested: list[Path] = field(default_factory=list)  # folders inside with a record of their own


def _describe_foreign_dir(root: Path, path: Path) -> str:
    rel = path.relative_to(root).as_posix() + "/"
    for sub, dirs, _ in os.walk(path):
        if is_marked(Path(sub)):
            kind = marker_kind(Path(sub))
            where = Path(sub).relative_to(root).as_posix() + "/"
            return f"{where} ({KINDS.get(kind or '', 'frod-ds output of another writer')})"
    return rel


def _walk(root: Path, base: Path, folder: Path, entries: tuple[str, ...], scan: _Scan) -> None:
    """Sort what is in ``folder`` (``base`` or a directory under it) by ``entries``, the record of ``base``."""
    for child in sorted(os.scandir(folder), key=lambda c: c.name):
        path = Path(child.path)
        rel = path.relative_to(base).as_posix()
        is_dir = child.is_dir(follow_symlinks=False)
        if base == folder and child.name == MARKER:
            continue  # removed last
        verdict = match(entries, rel, is_dir)
        if verdict == "own" and is_lease_file(child.name):
            scan.leases.append(path)
        if verdict == "own" and is_dir and listed_dir(path):
            _nested(root, path, scan)
        elif verdict == "own":
            scan.own.append(path)
        elif verdict == "parent":
            scan.dirs.append(path)
            _walk(root, base, path, entries, scan)
        else:
            scan.foreign.append(_describe_foreign_dir(root, path) if is_dir else path.relative_to(root).as_posix())


def _nested(root: Path, folder: Path, scan: _Scan) -> None:
    """A folder with a record of its own inside one being sorted: its record says what in it is ours."""
    entries = entries_of(read_record(folder))
    if entries is None:
        scan.foreign.append(_describe_foreign_dir(root, folder))
        return
    scan.dirs.append(folder)
    scan.nested.append(folder)
    _walk(root, folder, folder, entries, scan)


def _scan(folder: Path, legacy_kind: str | None = None) -> _Scan:
    scan = _Scan()
    entries = entries_of(read_record(folder), legacy_kind)
    if entries is None:
        scan.foreign.append(".")
        return scan
    _walk(folder, folder, folder, entries, scan)
    return scan


def _listing(paths: list[str]) -> str:
    more = f" and {len(paths) - SHOWN} more" if len(paths) > SHOWN else ""
    return ", ".join(paths[:SHOWN]) + more


def foreign_files(folder: Path, legacy_kind: str | None = None) -> list[str]:
    """What in ``folder`` its record does not list (relative paths, ``dir/`` for a whole directory): what frod-ds
    must neither replace nor delete. ``legacy_kind``: the kind of a folder recognised without a record."""
    return _scan(Path(folder), legacy_kind).foreign


def _refuse_foreign(out: Path, scan: _Scan, what: str, error: type[Exception]) -> None:
    if scan.foreign:
        raise error(
            f"{what} {out} holds what frod-ds did not write there: {_listing(scan.foreign)}; refusing to replace "
            f"it, move those out or choose another {what}"
        )
    for lease in scan.leases:
        holder = live_holder(lease)
        if holder:
            raise error(f"{what} {out}: {lease.parent} is being written by {holder}; wait for it to end")


def _input_clash(real: Path, inputs: dict[str, Path | str | None]) -> tuple[str, str] | None:
    """``(relation, input name)`` when ``real`` is, contains or is inside one of ``inputs``."""
    for name, path in inputs.items():
        if path is None or not os.path.lexists(path):
            continue
        other = Path(os.path.realpath(path))
        if other == real:
            return "is", name
        if real in other.parents:
            return "contains", name
        if other in real.parents:
            return "is inside", name
    return None


def _what_it_holds(path: Path) -> str:
    if not is_marked(path):
        return "files not written by frod-ds"
    kind = marker_kind(path)
    return KINDS.get(kind, f"frod-ds output of unknown kind {kind!r}") if kind else "frod-ds output of no recorded kind"


def check_not_an_input(
    out: Path, inputs: dict[str, Path | str | None] | None, what: str = "--out", error: type[Exception] | None = None
) -> None:
    """Raise ``error`` when ``out`` is, contains or is inside one of the command's ``inputs`` (name → path)."""
    error = error or FrodError
    clash = _input_clash(Path(os.path.realpath(out)), inputs or {})
    if clash:
        relation, name = clash
        holds = _what_it_holds(out) if out.is_dir() else "a file" if os.path.lexists(out) else "not there yet"
        raise error(
            f"{what} {out} ({holds}) {relation} {name} {(inputs or {})[name]}, an input of this command; refusing "
            f"to write there, choose another {what}"
        )


def check_replaceable(
    out: Path,
    kind: str | tuple[str, ...],
    inputs: dict[str, Path | str | None] | None = None,
    *,
    what: str = "--out",
    error: type[Exception] | None = None,
    legacy: Callable[[Path], bool] | None = None,
    foreign: bool = True,
) -> None:
    """Raise ``error`` (default ``FrodError``) unless a command writing ``kind`` (a tuple: any of them) may write
    to ``out``, replacing what its record lists: ``out`` is absent or an empty directory, or a directory (not a
    link) whose record names ``kind`` and which holds nothing the record does not list (``foreign``: checked; not
    for training, which adds to its run and deletes nothing). Never the working directory or the repository, or a
    folder that is, contains or is inside one of ``inputs`` (name → path). ``legacy``: recognises a folder of this
    kind written before records (what that kind writes then stands in for the list). Reads only."""
    error = error or FrodError
    out = Path(out)
    kinds = (kind,) if isinstance(kind, str) else tuple(kind)
    real = Path(os.path.realpath(out))
    for inside in (Path.cwd().resolve(), _REPO):
        if os.path.lexists(out) and (inside == real or real in inside.parents):
            raise error(f"{what} {out} contains {inside}; refusing to replace it, choose a new directory")
    check_not_an_input(out, inputs, what, error)
    if not os.path.lexists(out):
        return
    if out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
        return  # an empty directory holds nothing to lose
    if out.is_symlink():
        raise error(f"{what} {out} is {_link_state(out)}")
    wanted = " or ".join(KINDS[k] for k in kinds)
    problem = record_problem(out) if out.is_dir() else None
    if problem is not None:
        raise error(broken_record(out, problem, what, wanted, legacy is not None and legacy(out)))
    legacy_kind = None
    if not is_marked(out):
        if legacy is not None and out.is_dir() and not out.is_symlink() and legacy(out):
            found = legacy_kind = kinds[0]
        else:
            raise error(
                f"{what} {out} exists and was not written by frod-ds (no {MARKER} record); refusing to "
                "write there, remove it yourself or choose a new directory"
            )
    else:
        found = marker_kind(out)
    if found is None:
        raise error(
            f"{what} {out} holds a frod-ds marker with no kind (written by an older frod-ds), so it is not "
            f"known to be {wanted}; refusing to replace it, remove it yourself or choose a new directory"
        )
    if found not in KINDS:
        raise error(
            f"{what} {out} holds a frod-ds marker of unknown kind {found!r}, not {wanted}; refusing to "
            "replace it, remove it yourself or choose a new directory"
        )
    if found not in kinds:
        raise error(
            f"{what} {out} holds {KINDS[found]}, not {wanted}; this command replaces only its own earlier "
            f"output, choose another {what}"
        )
    if foreign:
        scan = _scan(out, legacy_kind)
        _refuse_foreign(out, scan, what, error)
        top, added, edited = read_record(out), [], []
        for folder in (out, *scan.nested):  # a nested output's record stamps its own files
            record, at = (top, "") if folder == out else (read_record(folder), folder.relative_to(out).as_posix() + "/")
            added += [at + rel for rel in listed_since_written(folder, record)]
            edited += [at + rel for rel in edited_since_written(folder, record)]
        added, edited = list(dict.fromkeys(added)), list(dict.fromkeys(edited))  # a file stamped at two levels
        extra = tree_added(out, top)
        if extra:
            raise error(
                f"{what} {out} holds what frod-ds did not write there: {_listing(extra)}; refusing to replace it, "
                f"move those out or choose another {what}"
            )
        if added:
            raise error(
                f"{what} {out} holds files frod-ds did not write there, though its {MARKER} record lists them: "
                f"{_listing(added)}; refusing to replace them, move them out or choose another {what}"
            )
        if edited:
            raise error(
                f"{what} {out} holds files changed since frod-ds wrote them: {_listing(edited)}; refusing to "
                f"replace them, move them out or choose another {what}"
            )


def _link_state(link: Path) -> str:
    """What symbolic link ``link`` is, and what to pass instead: frod-ds writes only into real directories."""
    target, why = os.readlink(link), "frod-ds writes only into a real directory, not through a link"
    try:
        return f"a symbolic link to {target}: {why}; pass {os.path.realpath(link, strict=True)} itself, or a new one"
    except OSError as exc:
        state = "a symbolic link loop" if exc.errno == errno.ELOOP else f"a symbolic link to {target}, not there"
        return f"{state}: {why}; choose a new directory"


def check_out(
    out: Path,
    kind: str | tuple[str, ...],
    inputs: dict[str, Path | str | None] | None,
    overwrite: bool,
    *,
    what: str = "--out",
    error: type[Exception] | None = None,
    legacy: Callable[[Path], bool] | None = None,
    empty_ok: bool = False,
) -> None:
    """The output check of a command that writes ``kind`` to ``out`` and replaces it only with ``--overwrite``:
    first :func:`check_replaceable` (so a directory ``--overwrite`` may not replace is never answered with "pass
    --overwrite", which would then be refused), then an existing ``out`` without ``overwrite`` (``empty_ok``: an
    empty directory is written into without it)."""
    check_replaceable(out, kind, inputs, what=what, error=error, legacy=legacy)
    out = Path(out)
    empty_dir = empty_ok and out.is_dir() and not out.is_symlink() and not any(out.iterdir())
    if os.path.lexists(out) and not empty_dir and not overwrite:
        raise (error or FrodError)(
            f"{what} {out} exists; pass --overwrite to replace it (an earlier output of this "
            f"command) or choose another {what}"
        )


def _delete(scan: _Scan, folder: Path) -> None:
    """Delete what ``scan`` found the writer wrote in ``folder``, then the records and the emptied directories."""
    for p in scan.own:
        with contextlib.suppress(FileNotFoundError):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
    for d in sorted({*scan.dirs, folder}, key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            if listed_dir(d):  # what is left in it (if anything) is not frod-ds's: no record claims it
                (d / MARKER).unlink()
            d.rmdir()


def remove_owned(
    out: Path, kind: str, what: str = "--out", error: type[Exception] | None = None, legacy: Callable | None = None
) -> None:
    """``--overwrite``'s deletion: remove from ``out`` exactly what its record lists (and ``out`` once empty),
    if :func:`check_replaceable` allows a command writing ``kind`` to; ``error`` listing what is in the way
    otherwise, with nothing deleted."""
    check_replaceable(out, kind, what=what, error=error, legacy=legacy)
    delete_owned(Path(out), kind)


remove_marked = remove_owned  # its 0.1 name (frod_ds.runtime.atomic forwards it here)
NESTED: dict[str, tuple[str, ...]] = {  # 0.1: the kinds a kind holds itself; a record's file list says it now
    "peft-import": ("factor-store", "adapter"),
    "demo": ("data-build", "factor-store", "adapter", "eval-results"),
}


def delete_owned(folder: Path, kind: str | None = None) -> list[str]:
    """Delete from ``folder`` what its record lists (``kind``: of a folder from before records), the record, and the
    folder once empty; what it does not list stays. Returns what stayed (relative paths)."""
    folder = Path(folder)
    if not folder.is_dir() or folder.is_symlink():
        return []
    scan = _scan(folder, kind)
    _delete(scan, folder)
    return scan.foreign if scan.foreign != ["."] else [p.name for p in folder.iterdir()]
