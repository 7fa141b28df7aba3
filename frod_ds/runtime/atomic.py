"""Writes that readers never see half done: files via ``<name>.tmp`` + fsync + rename, directories built
under a temporary sibling name and renamed into place. Imports nothing heavy (no torch).

The marker rule: every directory frod-ds publishes holds a marker (``MARKER``) recording which command wrote it
(``KINDS``); :func:`check_replaceable` lets a command replace or delete only a directory of its own kind that
holds no other command's output and is none of its inputs, the working directory or the repository, else a
one-line ``FrodError`` before anything is written (docs/failure-policy.md).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "TMP",
    "MARKER",
    "KINDS",
    "NESTED",
    "DISK_FULL_ERRNOS",
    "disk_full_error",
    "disk_full_line",
    "fsync_dir",
    "replacing",
    "atomic_write_text",
    "atomic_write_json",
    "building_dir",
    "publish_dir",
    "mark_dir",
    "is_marked",
    "marker_kind",
    "check_replaceable",
    "check_out",
    "remove_marked",
]

TMP = ".tmp"
MARKER = ".frod-ds-output"  # present in every directory frod-ds wrote as a whole; its "kind" says which command
KINDS = {  # the kind each writer records → how messages name it
    "adapter": "a trained adapter",
    "training-run": "a training run",
    "factor-store": "a factor store",
    "hf-export": "a merged Hugging Face export",
    "peft-export": "a PEFT adapter export",
    "peft-import": "an imported PEFT adapter",
    "data-build": "a frod data build",
    "eval-results": "evaluation results",
    "demo": "a demo directory",
}
NESTED = {  # what a kind holds of its own making, so replacing it loses nothing else
    "peft-import": ("factor-store", "adapter"),
    "demo": ("data-build", "factor-store", "adapter", "eval-results"),
}
_REPO = Path(__file__).resolve().parents[1]
_DISK_ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT, errno.EPERM)
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)  # a write the user fixes by freeing space or moving


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


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """Yield ``path``'s temporary (``path.tmp``) for the block to write and ``os.replace`` onto ``path``; if the
    block fails, the temporary is removed (a full disk or a kill leaves no half-written file beside ``path``) and
    an ``OSError`` that names no file names ``path`` (a failed ``write()`` does not; the error line should)."""
    tmp = path.with_name(path.name + TMP)
    try:
        yield tmp
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.filename is None:
            e.filename = str(path)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``path`` via ``path.tmp`` + fsync + rename: readers see the old or the new file, never half."""
    with replacing(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    """:func:`atomic_write_text` of ``obj`` as indented JSON."""
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=False) + "\n")


LOW_SPACE = 16 * 2**20  # bytes: below this a failed write is taken for a full disk


def disk_full_line(e: OSError) -> str:
    """The one line for a write that failed on a full (or read-only) disk: every writer replaces its files
    atomically, so what is on disk is the state before that write and the same command resumes."""
    target = e.filename2 or e.filename or "the output"  # a failed copy names its source first
    return (
        f"cannot write {target}: {e.strerror}; free space on that disk (or choose another location) and "
        "re-run the same command"
    )


def disk_full_error(path: Path, error: BaseException) -> OSError | None:
    """An ``ENOSPC`` ``OSError`` naming ``path`` when a write to it failed (``error``) and its disk has under
    ``LOW_SPACE`` bytes left; None otherwise. For writers that report a full disk as something else (torch.save:
    ``RuntimeError: ... iostream error``), so that it reaches the user as a full disk, not as a traceback."""
    if isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS:
        return error
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        st = os.statvfs(where)
    except OSError:
        return None
    if st.f_bavail * st.f_frsize >= LOW_SPACE:
        return None
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def mark_dir(path: Path, kind: str) -> None:
    """Write the marker into directory ``path``: frod-ds wrote it, as ``kind`` (one of ``KINDS``)."""
    assert kind in KINDS, f"unknown output kind {kind!r}; add it to frod_ds.runtime.atomic.KINDS"
    (path / MARKER).write_text(json.dumps({"format": "frod-ds-output", "kind": kind}) + "\n")


def is_marked(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and (path / MARKER).is_file()


def marker_kind(path: Path) -> str | None:
    """The kind the marker of directory ``path`` records; None when it is unreadable or records none (markers
    written before kinds were recorded)."""
    try:
        record = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None
    kind = record.get("kind") if isinstance(record, dict) else None
    return kind if isinstance(kind, str) else None


def _what_it_holds(path: Path) -> str:
    if not is_marked(path):
        return "files not written by frod-ds"
    kind = marker_kind(path)
    return KINDS.get(kind, f"frod-ds output of unknown kind {kind!r}") if kind else "frod-ds output of no recorded kind"


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


def check_replaceable(
    out: Path,
    kind: str | tuple[str, ...],
    inputs: dict[str, Path | str | None] | None = None,
    *,
    what: str = "--out",
    error: type[Exception] | None = None,
    legacy: Callable[[Path], bool] | None = None,
    nested: bool = True,
) -> None:
    """Raise ``error`` (a ``FrodError`` subclass; default ``FrodError``) unless a command that writes ``kind`` may
    replace ``out`` (the module docstring's rule). ``out`` may be replaced when it does not exist or is an empty
    directory, or when it is a directory (not a link) whose marker records ``kind`` (a tuple: any of them) and no
    directory under it holds another command's marker (``NESTED`` lists what each kind holds itself; ``nested``:
    check that). Never when it contains the working directory or the repository, nor when it is, contains or is
    inside one of the command's ``inputs`` (name → path; missing paths are skipped). ``legacy``: recognises a
    directory of this kind written before markers recorded kinds (no marker). Reads only."""
    from frod_ds.runtime.errors import FrodError

    error = error or FrodError
    out = Path(out)
    kinds = (kind,) if isinstance(kind, str) else tuple(kind)
    real = Path(os.path.realpath(out))
    for inside in (Path.cwd().resolve(), _REPO):
        if os.path.lexists(out) and (inside == real or real in inside.parents):
            raise error(f"{what} {out} contains {inside}; refusing to replace it, choose a new directory")
    clash = _input_clash(real, inputs or {})
    if clash:
        relation, name = clash
        holds = _what_it_holds(out) if out.is_dir() else "a file" if os.path.lexists(out) else "not there yet"
        raise error(
            f"{what} {out} ({holds}) {relation} {name} {inputs[name]}, an input of this command; refusing "
            f"to write there, choose another {what}"
        )
    if not os.path.lexists(out):
        return
    if out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
        return  # an empty directory holds nothing to lose
    wanted = " or ".join(KINDS[k] for k in kinds)
    if not is_marked(out):
        if legacy is not None and out.is_dir() and not out.is_symlink() and legacy(out):
            found = kinds[0]
        else:
            raise error(
                f"{what} {out} exists and was not written by frod-ds (no {MARKER} marker); refusing to "
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
    if nested:
        allowed = NESTED.get(found, ())
        for root, dirs, files in os.walk(out):  # links are not followed
            if MARKER in files and Path(root) != out:
                inner = marker_kind(Path(root))
                if inner not in allowed:
                    raise error(
                        f"{what} {out} holds {KINDS.get(inner, 'other frod-ds output')} in {Path(root)}; "
                        f"refusing to replace it, move that out first or choose another {what}"
                    )


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
    from frod_ds.runtime.errors import FrodError

    check_replaceable(out, kind, inputs, what=what, error=error, legacy=legacy)
    out = Path(out)
    empty_dir = empty_ok and out.is_dir() and not out.is_symlink() and not any(out.iterdir())
    if os.path.lexists(out) and not empty_dir and not overwrite:
        raise (error or FrodError)(
            f"{what} {out} exists; pass --overwrite to replace it (an earlier output of this "
            f"command) or choose another {what}"
        )


def remove_marked(out: Path, kind: str, what: str = "--out") -> None:
    """Delete directory ``out`` if :func:`check_replaceable` allows a command writing ``kind`` to (``FrodError``
    otherwise)."""
    check_replaceable(out, kind, what=what)
    if os.path.lexists(out):
        shutil.rmtree(out)


def publish_dir(
    new: Path,
    out: Path,
    kind: str,
    inputs: dict[str, Path | str | None] | None = None,
    error: type[Exception] | None = None,
) -> None:
    """Rename the finished directory ``new`` to ``out``. An existing ``out`` must pass
    :func:`check_replaceable` for ``kind``; it is moved aside first, put back if the rename fails, and deleted
    after it succeeded. The caller decides whether ``out`` may be replaced at all."""
    if not os.path.lexists(out):
        os.rename(new, out)
        return
    check_replaceable(out, kind, inputs, error=error)
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.rename(out, aside / out.name)
    try:
        os.rename(new, out)
    except BaseException:
        os.rename(aside / out.name, out)  # put the previous one back
        shutil.rmtree(aside, ignore_errors=True)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def _build_prefix(out: Path) -> str:
    """Where the name of a temporary sibling that a process of this host builds ``out`` in starts; the builder's
    pid and mkdtemp's random part follow (``<prefix><pid>-<random>``), so a later run can tell its builder is gone."""
    return f".{out.name}.tmp-{socket.gethostname()}-"


_BUILD_REST = re.compile(r"(\d+)-[a-z0-9_]{8}")  # after the prefix: the pid, then mkdtemp's 8 random characters


def _sweep_dead_builds(out: Path) -> None:
    """Delete the temporary siblings of ``out`` whose builder, a process of this host, is gone (killed with
    SIGKILL, or its machine lost power): a merged 70B export left that way is 140 GB nobody would find. Builds
    of other hosts (a shared filesystem; also a host whose name extends this one's, ``gpu`` and ``gpu-12``) and
    of live processes are left alone."""
    prefix = _build_prefix(out)
    for p in out.parent.iterdir() if out.parent.is_dir() else ():
        rest = _BUILD_REST.fullmatch(p.name[len(prefix) :]) if p.name.startswith(prefix) else None
        if rest is None or p.is_symlink() or not p.is_dir():
            continue
        try:
            os.kill(int(rest.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except PermissionError:  # alive, another user's
            pass


@contextlib.contextmanager
def building_dir(
    out: Path, kind: str, inputs: dict[str, Path | str | None] | None = None, error: type[Exception] | None = None
) -> Iterator[Path]:
    """A fresh temporary sibling of ``out`` to fill; marked ``kind`` (:func:`mark_dir`) and published as ``out``
    (:func:`publish_dir`) when the block ends normally, deleted when it raises. So ``out`` is either the old
    directory or the complete new one. An existing ``out`` is checked (:func:`check_replaceable` with ``kind``
    and the command's ``inputs``) before anything is built."""
    from frod_ds.runtime.errors import FrodError

    check_replaceable(out, kind, inputs, error=error)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _sweep_dead_builds(out)
        tmp = Path(tempfile.mkdtemp(prefix=f"{_build_prefix(out)}{os.getpid()}-", dir=out.parent))
    except OSError as e:
        raise FrodError(
            path_error(out, e)
            or f"cannot create a directory beside {out}: {e.strerror or e}; choose a writable location"
        ) from None
    try:
        yield tmp
        mark_dir(tmp, kind)
        publish_dir(tmp, out, kind, inputs, error)
    except BaseException as e:
        # asked before the partial output is deleted (which frees the space): writers that report a full disk as
        # something else (safetensors' SafetensorError "No space left on device") reach the user as a full disk
        if isinstance(e, OSError) and e.errno in _DISK_ERRNOS:
            disk = e
        else:
            disk = disk_full_error(tmp, e) if isinstance(e, Exception) else None
        shutil.rmtree(tmp, ignore_errors=True)
        if disk is not None:
            raise FrodError(
                f"cannot write {out}: {disk.strerror}; free space or choose another location (nothing was left behind)"
            ) from None
        raise
