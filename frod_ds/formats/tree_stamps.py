"""Stamps of a whole tree: a finished output that several commands filled in turn (the demo: its stages' outputs
nested in it, some written in place, some lists naming whole folders) stamps every file under it that no nested
record stamps itself, so that its replacement refuses a user's edit, or a file a user added, anywhere inside."""

from __future__ import annotations

import os
from pathlib import Path

from frod_ds.formats.output_dir import (
    MARKER,
    OutputRecord,
    is_lease_file,
    listed_dir,
    read_record,
    record_text,
    stamps_of,
)
from frod_ds.runtime.atomic import atomic_write_text

__all__ = ["stamp_tree", "tree_added"]


def _tree_files(path: Path, links: bool) -> list[str]:
    """Every file under ``path`` (relative, sorted) but the records, leases and the files a nested output's own
    record stamps (it guards them itself, and a command that rewrites that output in place, such as an eval into
    its earlier results, restamps them); with ``links``, symbolic links too (a link is never the writer's)."""
    skip: set[str] = set()
    files = []
    for root, dirs, names in os.walk(path):  # top-down: a nested record is read before the files under it
        for d in dirs:
            record = read_record(Path(root, d)) if listed_dir(Path(root, d)) else None
            if record is not None and record.written:
                at = Path(root, d).relative_to(path).as_posix() + "/"
                skip |= {at + rel for rel in record.written}
        for name in names:
            p = Path(root, name)
            rel = p.relative_to(path).as_posix()
            if name == MARKER or is_lease_file(name) or rel in skip or (p.is_symlink() and not links):
                continue
            files.append(rel)
    return sorted(files)


def stamp_tree(path: Path) -> None:
    """Stamp every file under finished output ``path`` in its record (``written``, ``tree``). Lease holder only."""
    path = Path(path)
    record = read_record(path)
    if record is None:
        return
    record.written, record.tree = stamps_of(path, _tree_files(path, links=False)), True
    atomic_write_text(path / MARKER, record_text(record))


def tree_added(path: Path, record: OutputRecord | None) -> list[str]:
    """The files under ``path`` a tree-stamped ``record`` does not stamp (added since: a user's); [] otherwise."""
    if record is None or not record.tree:
        return []
    written = record.written or {}
    return [rel for rel in _tree_files(Path(path), links=True) if rel not in written]
