"""What a path given on the command line is, in words, so that a wrong one gets one line naming what it is.

``file_problem`` / ``dir_problem`` say why a path is not the readable file or directory asked for (missing, a
symbolic-link loop, a broken link, a named pipe, a directory, unreadable) instead of "not found". Which kind of
folder a directory is (a factor store given as a model, ...) is ``frod_ds.formats.folders``. Torch-free.
"""

from __future__ import annotations

import errno
import functools
import os
import re
import stat
from collections.abc import Callable, Iterable
from pathlib import Path

__all__ = [
    "entry_kind",
    "expand_home",
    "input_path",
    "input_dir",
    "output_path",
    "output_dir",
    "file_before_dots",
    "file_problem",
    "dir_problem",
    "read_small_text",
    "replaceable_own",
    "unmovable",
]

SMALL_FILE_BYTES = 16 * 2**20  # a manifest, a record or a config frod-ds writes: far below this


def expand_home(path: str | os.PathLike) -> Path:
    """``path`` with ``~`` and ``~user`` expanded where they can be; as written where they cannot (a user without a
    home, or none of that name), where pathlib's ``expanduser`` raises ``RuntimeError``."""
    return Path(os.path.expanduser(path))


def input_path(text: str) -> str:
    """An input's path as a shell would have made of it (``expand_home``, as text): a leading ``~`` or ``~user``
    expanded where it can be (a quoted argument, a recipe); anything else as given (a Hub id, ``hub``). Outputs are
    not expanded: a literal ``~`` output is refused where it is leased (``sibling_names.literal_home``)."""
    return os.path.expanduser(text)


input_dir = expand_home  # ``input_path`` as a ``Path``: a flag's type


def output_path(text: str) -> str:
    """An output's path with its ``..`` parts resolved as the kernel would where the parts before them exist (so a
    path through a folder not made yet, ``new/../out``, still names a place its writer can build beside); as given
    without ``..``, and with a leading ``~`` (refused where it is leased)."""
    parts = Path(text).parts
    if ".." not in parts or parts[0].startswith("~"):
        return text
    if file_before_dots(text) is not None:  # the kernel refuses a file's "..": so does its writer
        return text
    head, name = os.path.split(text.rstrip(os.sep)) if parts[-1] != ".." else (text, "")
    return os.path.join(os.path.realpath(head or "."), name) if name else os.path.realpath(head)


def file_before_dots(text: str) -> Path | None:
    """The file (not a folder) a ``..`` of path ``text`` would step out of, which the kernel refuses, or None."""
    parts = Path(text).parts
    before = (Path(*parts[:i]) for i, part in enumerate(parts) if part == ".." and i)
    return next((p for p in before if p.exists() and not p.is_dir()), None)


def output_dir(text: str) -> Path:
    """``output_path`` as a ``Path``: a flag's type."""
    return Path(output_path(text))


def _stat_problem(path: Path) -> tuple[os.stat_result | None, str | None]:
    """``(stat, None)`` for a path that resolves, else ``(None, why not)``."""
    try:
        return path.stat(), None
    except OSError as e:
        if e.errno == errno.ELOOP:
            return None, f"{path} is a symbolic-link loop (it points, through links, back to itself)"
        if os.path.islink(path):
            return None, f"{path} is a broken symbolic link (to {os.readlink(path)}, which does not exist)"
        if e.errno == errno.EACCES:
            return None, f"{path} cannot be reached (permission denied)"
        if e.errno == errno.ENOTDIR:
            return None, f"{path} does not exist (a part of the path is a file, not a directory)"
        return None, f"{path} does not exist"


def entry_kind(mode: int) -> str:
    """What a directory entry of ``mode`` that is neither a regular file nor a link is, in a few words."""
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file"


def _special(mode: int) -> str | None:
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO), not a file; write the data to a regular file"
    if stat.S_ISSOCK(mode):
        return "a socket, not a file"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device, not a file"
    return None


def file_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a regular file this process can read (one line starting with the path), or None."""
    p = Path(path)
    st, problem = _stat_problem(p)
    if st is None:
        return problem
    if stat.S_ISDIR(st.st_mode):
        return f"{p} is a directory, not a file"
    special = _special(st.st_mode)
    if special:
        return f"{p} is {special}"
    if not os.access(p, os.R_OK):
        return f"{p} cannot be read (permission denied)"
    return None


def dir_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a directory this process can list (one line starting with the path), or None."""
    p = Path(path)
    st, problem = _stat_problem(p)
    if st is None:
        return problem
    if not stat.S_ISDIR(st.st_mode):
        special = _special(st.st_mode)
        return f"{p} is {special.split(',')[0] if special else 'a file'}, not a directory"
    if not os.access(p, os.R_OK | os.X_OK):
        return f"{p} cannot be read (permission denied)"
    return None


def read_small_text(path: str | os.PathLike, error: type[Exception], what: str, remedy: str) -> str:
    """The UTF-8 text of a small file frod-ds reads for its own records (a store's manifest, an adapter's config).
    ``error`` (one line: ``{path}`` ``{why}``, then ``remedy``) when it is no regular file (a named pipe would block
    the read, a link to /dev/zero never end it), larger than any such file, or not UTF-8; FileNotFoundError as is."""
    p = Path(path)
    problem = file_problem(p) if os.path.lexists(p) else None
    size = os.path.getsize(p) if problem is None and os.path.lexists(p) else 0
    if size > SMALL_FILE_BYTES:
        problem = f"{p} is {size} bytes, larger than any {what}"
    if problem is not None:
        raise error(f"{problem}; {remedy}")
    with open(p, "rb") as f:
        data = f.read(SMALL_FILE_BYTES + 1)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{p} is not UTF-8 text (byte {e.start}), so no {what}; {remedy}") from None


def replaceable_own(path: Path, head_is_ours: Callable[[bytes], bool], head_bytes: int = 4096) -> bool:
    """Whether a writer may replace ``path``: absent, or a regular file (no link) whose first ``head_bytes`` are of
    a file it wrote (``head_is_ours``); a user's file of that name is never replaced."""
    if not os.path.lexists(path):
        return True
    if path.is_symlink() or not path.is_file():
        return False
    with open(path, "rb") as f:
        return head_is_ours(f.read(head_bytes))


def unmovable(paths: Iterable[Path], into: Path) -> Path | None:
    """The first of ``paths`` that a rename cannot move into the folder ``into`` (or beside it, when it is to be
    made): a mount point (the kernel refuses to rename one) or an entry on another file system. Asked before the
    first rename, so that a move of several is never left half done."""
    dev, mounts = os.stat(into).st_dev, _mount_points()
    for p in paths:
        at = os.path.join(os.path.realpath(os.path.dirname(p)), os.path.basename(p))  # as the mount table says it
        if os.path.ismount(p) or at in mounts or os.lstat(p).st_dev != dev:
            return Path(p)
    return None


def _mount_points() -> set[str]:
    """Every mount point of this process (``/proc/self/mountinfo``: a file bind-mounted on its own file system is
    one, which ``os.path.ismount`` cannot tell); none where that cannot be read."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return set()
    unescape = functools.partial(re.sub, r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)))
    return {unescape(fields[4]) for fields in map(str.split, lines) if len(fields) > 4}
