"""Writes that readers never see half done: files via ``<name>.frod-tmp`` + fsync + rename, and the one line for a write
that failed on a full or read-only disk. Imports nothing heavy (no torch).

Who may write, replace or delete a folder (its ownership record, ``--overwrite``, the writer's lease, folders built
under a temporary name and renamed into place) is ``frod_ds.formats.ownership``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import resource
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from frod_ds._moved import forward_names
from frod_ds.runtime.errors import FrodError

__all__ = [
    "TMP",
    "DISK_ERRNOS",
    "DISK_FULL_ERRNOS",
    "LOW_SPACE",
    "disk_advice",
    "disk_full_error",
    "disk_full_line",
    "said_errno",
    "file_in_the_way",
    "path_error",
    "fsync_dir",
    "umask",
    "replacing",
    "clear_tmp",
    "tmp_problem",
    "open_tmp",
    "atomic_write_text",
    "atomic_write_json",
]

# a file's temporary while frod-ds writes it: a name in frod-ds's own namespace (as ``.frod-ds-output``), so that a
# leftover found there is a killed write's, never a user's ``<name>.tmp``
TMP = ".frod-tmp"
# a write the disk refused; EFBIG: past the process's file-size limit (``ulimit -f``), which Python makes an error
DISK_ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT, errno.EPERM, errno.EFBIG)
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)  # the user fixes: space, place or limit


def file_in_the_way(path: Path | str) -> Path | None:
    """The nearest existing ancestor of ``path`` (or ``path`` itself) that is not a directory: what makes creating
    ``path`` as a directory fail (``--out some/file/x``); None when there is none."""
    for p in (Path(path), *Path(path).parents):
        if os.path.lexists(p):
            return None if p.is_dir() else p
    return None


def path_error(path: Path | str, e: OSError) -> str | None:
    """One line for an ``OSError`` raised while creating ``path`` when the cause is the user's path (a file where a
    directory belongs); None when it is something else."""
    blocker = file_in_the_way(path)
    if e.errno in (errno.ENOTDIR, errno.EEXIST) and blocker is not None:
        return f"cannot create {path}: {blocker} is a file, not a directory; choose another path"
    return None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def tmp_problem(tmp: Path, path: Path) -> str | None:
    """Why what is at ``path``'s temporary ``tmp`` is no leftover of a killed write (a regular file of one name, the
    writer's own): a link, a second name of another file, a named pipe, a folder; None when nothing or a leftover."""
    try:
        st = os.lstat(tmp)
    except FileNotFoundError:
        return None
    if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
        return None
    if stat.S_ISLNK(st.st_mode):
        what = f"a symbolic link to {os.readlink(tmp)}"
    elif stat.S_ISREG(st.st_mode):
        what = f"a file with {st.st_nlink} names (a hard link)"
    else:
        what = "a named pipe" if stat.S_ISFIFO(st.st_mode) else "a folder" if stat.S_ISDIR(st.st_mode) else "no file"
    return (
        f"{tmp} is in the way of writing {path.name}: it is {what}, no leftover of frod-ds; move it away and run the "
        "same command again"
    )


def clear_tmp(tmp: Path, path: Path) -> None:
    """Make way for ``path``'s temporary ``tmp``: a leftover of a killed write is the writer's own and is removed;
    anything else (``tmp_problem``) is ``FrodError``, never written through, emptied or removed."""
    problem = tmp_problem(tmp, path)
    if problem:
        raise FrodError(problem)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)


def open_tmp(tmp: Path) -> int:
    """A new file at temporary ``tmp``, created here, after ``clear_tmp`` (``replacing`` does it): O_EXCL and
    O_NOFOLLOW, so nothing put there meanwhile is written through; its descriptor."""
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """Yield ``path``'s temporary (``path`` + ``TMP``, made way for by ``clear_tmp``) for the block to write and
    ``os.replace`` onto ``path``; if the block fails, the temporary is removed (a full disk or a kill leaves no
    half-written file beside ``path``) and an ``OSError`` that names no file names ``path`` (a failed ``write()``
    does not; the error line should)."""
    tmp = path.with_name(path.name + TMP)
    clear_tmp(tmp, path)
    try:
        yield tmp
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.filename is None:
            e.filename = str(path)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``path`` via its temporary (``TMP``) + fsync + rename: readers see the old or the new file, never half."""
    with replacing(path) as tmp:
        with open(open_tmp(tmp), "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    """:func:`atomic_write_text` of ``obj`` as indented JSON."""
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=False) + "\n")


LOW_SPACE = 16 * 2**20  # bytes: below this a failed write is taken for a full disk


def disk_advice(e: OSError, elsewhere: bool = True) -> str:
    """What the user does about a write ``e`` refused, by its cause: raise the file-size limit, remount a
    read-only disk, make a place writable, or free space (or move: not where moving starts the work over)."""
    if e.errno == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        shown = "" if limit == resource.RLIM_INFINITY else f" of {limit:,} bytes"
        return f"this process's file-size limit{shown} (ulimit -f) is too small for it; raise the limit"
    if e.errno == errno.EROFS:
        return "the disk is read-only: remount it writable" + (" or choose another location" if elsewhere else "")
    if e.errno in (errno.EACCES, errno.EPERM):
        return "make it writable or choose another location"
    return "free space on that disk" + (" (or choose another location)" if elsewhere else "")


def disk_full_line(e: OSError) -> str:
    """The one line for a write that failed on a full (or read-only) disk, or past the file-size limit: every writer
    replaces its files atomically, so what is on disk is the state before that write and the same command resumes."""
    target = e.filename2 or e.filename or "the output"  # a failed copy names its source first
    return f"cannot write {target}: {e.strerror}; {disk_advice(e)} and re-run the same command"


_SAID_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # a full disk, a full quota: what a writer may say only in words
_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how Rust's std::io::Error names the errno in its message


def said_errno(error: BaseException) -> int | None:
    """``ENOSPC`` or ``EDQUOT`` when ``error``'s message says so (``No space left on device``, ``(os error 28)``;
    ``Disk quota exceeded``, ``(os error 122)``): writers that raise no ``OSError`` (safetensors'
    ``SafetensorError``) pass the OS's error on as text only."""
    text = str(error)
    said = _OS_ERROR.search(text)
    if said is not None and int(said.group(1)) in _SAID_ERRNOS:
        return int(said.group(1))
    return next((code for code in _SAID_ERRNOS if os.strerror(code) in text), None)


def disk_full_error(path: Path, error: BaseException) -> OSError | None:
    """An ``ENOSPC`` ``OSError`` naming ``path`` when a write to it failed (``error``) and its disk has under
    ``LOW_SPACE`` bytes left; an ``ENOSPC`` or ``EDQUOT`` one when ``error``'s message says so (:func:`said_errno`);
    an ``EFBIG`` one when this process has a file-size limit (``ulimit -f``); None otherwise. For writers that
    report either as something else (torch.save: ``RuntimeError: ... iostream error`` or ``unexpected pos``;
    safetensors: ``SafetensorError``), so that it reaches the user as what it is, not as a traceback."""
    if isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS:
        return error
    said = said_errno(error)
    if said is not None:
        return OSError(said, os.strerror(said), str(path))
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        st = os.statvfs(where)
    except OSError:
        return None
    if st.f_bavail * st.f_frsize < LOW_SPACE:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    if resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY:
        return OSError(errno.EFBIG, os.strerror(errno.EFBIG), str(path))
    return None


# The marker rule's names moved to frod_ds.formats.ownership in 0.2.0 (the ownership record holds a file list and
# is a typed record of frod_ds.formats): importing them from here warns (frod_ds._moved).
_MOVED_NAMES = dict.fromkeys(
    (
        "MARKER",
        "KINDS",
        "NESTED",
        "mark_dir",
        "is_marked",
        "marker_kind",
        "check_replaceable",
        "check_out",
        "remove_marked",
    ),
    "frod_ds.formats.ownership",
)
_MOVED_NAMES["building_dir"] = "frod_ds.formats.building"
_MOVED_NAMES["publish_dir"] = "frod_ds.formats.publish"
__getattr__ = forward_names(__name__, _MOVED_NAMES)
