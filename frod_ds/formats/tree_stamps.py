"""Stamps of a whole tree: a finished output that several commands filled in turn (the demo: its stages' outputs
nested in it, some written in place, some lists naming whole folders) stamps every file under it that no nested
record stamps itself, so that its replacement refuses a user's edit, or a file a user added, anywhere inside. A
folder such an output's list names whole is sealed the same way as it is published (``publish_sealed``), so a
stopped demo guards what its finished stages wrote."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

from frod_ds.formats.lease import read_lease
from frod_ds.formats.output_dir import (
    KINDS,
    MARKER,
    OutputRecord,
    is_lease_file,
    listed_dir,
    read_record,
    record_text,
    stamps_of,
)
from frod_ds.runtime.atomic import atomic_write_text, umask

__all__ = ["nest", "publish_sealed", "seal_folders", "stamp_tree", "tree_added"]


def _a_lease(path: Path) -> bool:
    """Whether ``path``, named like a lease, holds one (a user's file at such a name is no lease, and is theirs)."""
    found = read_lease(path)
    return found is not None and found[0] is not None


def _known_record(folder: Path) -> OutputRecord | None:
    """``folder``'s record when it is a frod-ds record of a known kind (a user's file at that name is theirs)."""
    record = read_record(folder) if listed_dir(folder) else None
    return record if record is not None and record.kind in KINDS else None


def _rewrite(out: Path, change: Callable[[OutputRecord], None]) -> None:
    """Apply ``change`` to ``out``'s record and write it back (nothing without a record). Lease holder only."""
    record = read_record(out)
    if record is not None:
        change(record)
        atomic_write_text(out / MARKER, record_text(record))


def _tree_files(path: Path, links: bool, trusted: set[str] | None) -> tuple[list[str], list[str], list[str]]:
    """Every file under ``path`` (relative, sorted) but the records, leases and the files a nested output's own
    record stamps (it guards them itself, and a command that rewrites that output in place, such as an eval into
    its earlier results, restamps them); with ``links``, symbolic links too, to folders as well (a link is never
    the writer's). Then the folders that hold nothing (``dir/``), and the nested outputs (``dir/``). ``trusted``:
    the only nested outputs to pass over (the writer's own; None: every one)."""
    skip: set[str] = set()
    files, empty, nested = [], [], []
    for root, dirs, names in os.walk(path):  # top-down: a nested record is read before the files under it
        here = Path(root).relative_to(path).as_posix() + "/"
        if here != "./" and not dirs and not names:
            empty.append(here)
        for d in dirs:
            at = Path(root, d).relative_to(path).as_posix() + "/"
            record = _known_record(Path(root, d))
            if record is not None and (trusted is None or at in trusted):
                nested.append(at)
                skip |= {at + MARKER, *(at + rel for rel in record.written or {})}
        for name in names + [d for d in dirs if links and Path(root, d).is_symlink()]:  # os.walk puts those in dirs
            p = Path(root, name)
            rel = p.relative_to(path).as_posix()
            if rel in skip or rel == MARKER or (p.is_symlink() and not links) or (is_lease_file(name) and _a_lease(p)):
                continue
            files.append(rel)
    return sorted(files), sorted(empty), sorted(nested)


def stamp_tree(path: Path) -> None:
    """Stamp every file under finished output ``path`` in its record (``written``, ``tree``), and name the outputs
    nested in it, whose records guard their own files. Lease holder only."""

    def stamp(record: OutputRecord) -> None:
        files, record.empty_dirs, record.nested = _tree_files(Path(path), links=False, trusted=None)
        record.written, record.tree = stamps_of(Path(path), files), True

    _rewrite(Path(path), stamp)


def nest(out: Path, name: str) -> None:
    """Record that folder ``name`` of ``out`` is written next by one of its stages, as an output with a record of
    its own (which then guards it); a record found anywhere else under a sealed folder is a user's copy. Lease
    holder only."""

    def add(record: OutputRecord) -> None:
        record.nested = sorted({*(record.nested or []), name.rstrip("/") + "/"})

    _rewrite(Path(out), add)


def seal_folders(out: Path, names: Iterable[str]) -> None:
    """Seal the folders ``names`` of ``out``'s list before they are written: each is then the writer's only as far
    as ``out``'s stamps (``publish_sealed``) or a record of its own (a stage's output) say, so a folder a user makes
    at such a name, or fills, before its stage has run is never deleted with a stopped output. Lease holder only."""

    def seal(record: OutputRecord) -> None:
        record.sealed = sorted({*(record.sealed or []), *(n.rstrip("/") + "/" for n in names)})
        record.empty_dirs = record.empty_dirs or []

    _rewrite(Path(out), seal)


def publish_sealed(out: Path, rel: str, built: Path) -> None:
    """Publish folder ``built`` as ``out/rel`` (a name ``out``'s list names whole, absent now), its files stamped
    and the folder sealed in ``out``'s record first: from then on a file a user adds there is refused, not deleted
    with the folder. ``built``: a temporary beside it (``sibling_names.owned_sibling``). Lease holder only."""
    rel = rel.rstrip("/") + "/"

    def seal(record: OutputRecord) -> None:
        files, empty, _ = _tree_files(Path(built), links=False, trusted=set())
        record.written = {**(record.written or {}), **{rel + k: v for k, v in stamps_of(built, files).items()}}
        record.sealed = sorted({*(record.sealed or []), rel})
        record.empty_dirs = sorted({*(record.empty_dirs or []), *(rel + d for d in empty)})

    _rewrite(Path(out), seal)
    os.chmod(built, 0o777 & ~umask())  # mkdtemp makes it private; published, it is the umask's like any folder
    os.rename(built, Path(out) / rel)


def tree_added(path: Path, record: OutputRecord | None) -> list[str]:
    """What is under ``path`` that a tree-stamped ``record`` does not stamp (added since: a user's): files, links,
    and folders that hold nothing and held nothing before; with only ``sealed`` folders, what is under those."""
    if record is None or not (record.tree or record.sealed):
        return []
    found: list[str] = []
    nested = record.nested
    for root in [""] if record.tree else (record.sealed or []):
        if root and root in (nested or []) and _known_record(Path(path) / root) is not None:
            continue  # a stage's output: its own record says what in it is ours
        trusted = None if nested is None else {n[len(root) :] for n in nested if n.startswith(root) and n != root}
        files, empty, _ = _tree_files(Path(path) / root, links=True, trusted=trusted)
        found += [root + rel for rel in files] + [root + d for d in empty]
    known = {**(record.written or {}), **dict.fromkeys(record.empty_dirs or [])}
    files_only = record.empty_dirs is None  # stamped before empty folders were kept
    return sorted(r for r in found if r not in known and not (files_only and r.endswith("/")))
