"""The sha256 of each file a writer wrote, recorded beside them so a reader refuses a file changed since.

A data build's ``manifest.json`` (``frod data build``, ``files``) and a PEFT export's ``frod_export.json`` (``frod
export --format peft``, ``files``) each hold one; ``frod eval`` checks the task files against the first, ``frod
export --from-peft`` the adapter against the second. Torch-free.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from frod_ds.formats.records import parse_json, record_from_dict
from frod_ds.runtime.errors import FrodError

__all__ = ["DATA_MANIFEST", "FileDigests", "file_sha256", "format_problem"]

DATA_MANIFEST = "manifest.json"  # a data build's record (frod_ds.prep.dataset writes the rest of it)


def file_sha256(path: str | Path) -> str:
    """sha256 hex digest of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@dataclass
class FileDigests:
    """``files`` of a writer's record: each file it wrote (path relative to the folder) → its sha256."""

    files: dict[str, str]

    @classmethod
    def of(cls, folder: Path, names: list[str]) -> FileDigests:
        return cls({name: file_sha256(Path(folder) / name) for name in sorted(names)})

    @classmethod
    def read(
        cls, record: Path, error: type[FrodError], hint: str, required: bool = True, format: str | None = None
    ) -> FileDigests | None:
        """``files`` of the JSON ``record``; None when there is no such file, or (``required=False``) when it holds
        no ``files``. ``error`` naming ``record``, then ``hint`` (what to do), when it cannot be read or (``format``
        given) names another format (a record without one: an older build, read as this format)."""
        if not record.is_file():
            return None
        try:
            data = parse_json(record.read_text(encoding="utf-8"), record, error, f"; {hint}")
        except (OSError, UnicodeDecodeError) as e:
            raise error(f"{record} cannot be read ({e}); {hint}") from None
        problem = format_problem(data, record, format) if format is not None else None
        if problem:
            raise error(f"{problem}; {hint}")
        if not isinstance(data, dict) or "files" not in data:
            if not required:
                return None
            raise error(f"{record} records no sha256 of its files ('files'); {hint}")
        return record_from_dict(cls, {"files": data["files"]}, str(record), error)

    def changed(self, folder: Path, name: str) -> bool:
        """Whether ``folder/name`` is not the file recorded under ``name`` (missing, or other bytes)."""
        want = self.files.get(name)
        return want is None or not (Path(folder) / name).is_file() or file_sha256(Path(folder) / name) != want


def format_problem(data: object, record: Path, format: str) -> str | None:
    """Why JSON ``data`` of ``record`` is not of ``format`` (it names another), or None; a record without a format
    is an older one, read as this format."""
    if isinstance(data, dict) and data.get("format", format) != format:
        return f"{record} is of format {data['format']!r}, not the {format} this frod-ds reads"
    return None
