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


def _tree_files(path: Path, links: bool) -> tuple[list[str], list[str]]:
    """Every file under ``path`` (relative, sorted) but the records, leases and the files a nested output's own
    record stamps (it guards them itself, and a command that rewrites that output in place, such as an eval into
    its earlier results, restamps them); with ``links``, symbolic links too, to folders as well (a link is never
    the writer's). Second, the folders that hold nothing (``dir/``)."""
    skip: set[str] = set()
    files, empty = [], []
    for root, dirs, names in os.walk(path):  # top-down: a nested record is read before the files under it
        here = Path(root).relative_to(path).as_posix() + "/"
        if here != "./" and not dirs and not names:
            empty.append(here)
        for d in dirs:
            record = read_record(Path(root, d)) if listed_dir(Path(root, d)) else None
            if record is not None and record.written:
                at = Path(root, d).relative_to(path).as_posix() + "/"
                skip |= {at + rel for rel in record.written}
        for name in names + [d for d in dirs if links and Path(root, d).is_symlink()]:  # os.walk puts those in dirs
            p = Path(root, name)
            rel = p.relative_to(path).as_posix()
            if name == MARKER or is_lease_file(name) or rel in skip or (p.is_symlink() and not links):
                continue
            files.append(rel)
    return sorted(files), sorted(empty)


def stamp_tree(path: Path) -> None:
    """Stamp every file under finished output ``path`` in its record (``written``, ``tree``). Lease holder only."""
    path = Path(path)
    record = read_record(path)
    if record is None:
        return
    files, record.empty_dirs = _tree_files(path, links=False)
    record.written, record.tree = stamps_of(path, files), True
    atomic_write_text(path / MARKER, record_text(record))


def tree_added(path: Path, record: OutputRecord | None) -> list[str]:
    """What is under ``path`` that a tree-stamped ``record`` does not stamp (added since: a user's): files, links,
    and folders that hold nothing and held nothing before; [] for a record without tree stamps."""
    if record is None or not record.tree:
        return []
    written, files, empty = record.written or {}, *_tree_files(Path(path), links=True)
    new_empty = [d for d in empty if record.empty_dirs is not None and d not in record.empty_dirs]
    return sorted([rel for rel in files if rel not in written] + new_empty)
