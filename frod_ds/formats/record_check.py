"""Whether an output folder's ownership record is one frod-ds can read, and the refusal when it is not: a record
that is a link, a folder, a pipe, unreadable or no record shows nothing about who wrote the folder, so it is named,
never taken for an older frod-ds's. Torch-free."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from frod_ds.formats.output_dir import MARKER, OutputRecord, OutputRecordError
from frod_ds.formats.records import record_from_dict
from frod_ds.runtime.paths import SMALL_FILE_BYTES, entry_kind
from frod_ds.runtime.strict_json import loads

__all__ = ["broken_record", "record_problem"]


def _unreadable(data: bytes) -> str | None:
    """Why ``data``, the bytes of an ownership record, is no record frod-ds can read, or None when it is one."""
    if len(data) > SMALL_FILE_BYTES:
        return f"more than {SMALL_FILE_BYTES} bytes, larger than any ownership record"
    try:
        doc = loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        return f"not UTF-8 text (byte {e.start})"
    except json.JSONDecodeError as e:
        return f"not JSON frod-ds can read ({e.msg.split(';')[0]}, line {e.lineno} column {e.colno})"
    except ValueError as e:  # JSON Python cannot hold: an integer of thousands of digits
        return f"not JSON frod-ds can read ({str(e).split(';')[0]})"
    try:
        record_from_dict(OutputRecord, doc, "record", OutputRecordError)
    except OutputRecordError as e:
        return f"JSON but no ownership record ({str(e).removeprefix('record: ').removeprefix('record.')})"
    return None


def record_problem(folder: Path) -> str | None:
    """What the ownership record of ``folder`` is when one is there but no record frod-ds can read (a link, a
    folder, a pipe, unreadable, not JSON, not a record), in a few words; None when it is absent or reads. Such a
    record shows nothing about who wrote the folder, so it is named, never taken for an older frod-ds's."""
    path = Path(folder) / MARKER
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"unreadable ({(e.strerror or str(e)).lower()})"
    if stat.S_ISLNK(st.st_mode):
        return f"a symbolic link (to {os.readlink(path)})"
    if not stat.S_ISREG(st.st_mode):
        return entry_kind(st.st_mode)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)  # replaced meanwhile: never blocks
        try:
            data = os.read(fd, SMALL_FILE_BYTES + 1) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
        finally:
            os.close(fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"unreadable ({(e.strerror or str(e)).lower()})"
    return _unreadable(data)


def broken_record(out: Path, problem: str, what: str, wanted: str, recognised: bool) -> str:
    """The refusal of folder ``out`` whose ownership record is ``problem`` (:func:`record_problem`): nothing shows
    frod-ds wrote it. Without that file it is replaced only where its writer recognises it (``recognised``)."""
    head = (
        f"{what} {out}: its ownership record {out / MARKER} is {problem}; frod-ds writes a small JSON file there, so "
        f"nothing shows that frod-ds wrote {out}; refusing to replace it, "
    )
    if recognised:
        return head + (
            f"remove that file and run the same command again ({out} then reads as {wanted} written before records)"
            " or choose a new directory"
        )
    return head + (
        "choose a new directory (removing that file does not change this: frod-ds replaces only a folder it can "
        "show it wrote)"
    )
