"""A write-once output built whole beside its final path and published by one rename (``building_dir``): readers
never see half of it, a killed writer leaves only a temporary sibling (swept by the next build on its host), and
the published folder's record stamps every file it holds (``OutputRecord.written``), so a later ``--overwrite``
can tell a file edited since."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

from frod_ds.formats.ownership import check_replaceable, inventory, is_marked, listed_dir, mark_dir, stamp_listed
from frod_ds.formats.processes import pid_alive
from frod_ds.formats.publish import aside_prefix, finish_aside, publish_dir
from frod_ds.formats.sibling_names import owned_prefix, owned_sibling
from frod_ds.runtime.atomic import DISK_ERRNOS, disk_advice, disk_full_error, path_error, umask
from frod_ds.runtime.errors import FrodError

__all__ = ["building_dir", "umask_modes"]


def _build_prefix(out: Path) -> str:
    """Where the name of a temporary sibling that a process of this host builds ``out`` in starts; the builder's
    pid and mkdtemp's random part follow (``<prefix><pid>-<random>``), so a later run can tell its builder is gone.
    A name too long for that is shortened the same way by every builder (``fitted_name``)."""
    return owned_prefix(out, "tmp")


_BUILD_REST = re.compile(r"(\d+)-[a-z0-9_]{8}")  # after the prefix: the pid, then mkdtemp's 8 random characters


def _dead_siblings(out: Path, prefix: str) -> Iterator[Path]:
    """The folders beside ``out`` named ``<prefix><pid>-<random>`` (not links) whose process, one of this host's
    (``prefix`` names the host), is gone."""
    for p in out.parent.iterdir() if out.parent.is_dir() else ():
        rest = _BUILD_REST.fullmatch(p.name[len(prefix) :]) if p.name.startswith(prefix) else None
        if rest is not None and not p.is_symlink() and p.is_dir() and not pid_alive(int(rest.group(1))):
            yield p


def _sweep_dead_builds(out: Path, kind: str) -> None:
    """Delete what dead writers of ``out`` on this host left beside it (killed with SIGKILL, or their machine lost
    power): temporary siblings they built in (a merged 70B export left that way is 140 GB nobody would find), and
    the earlier output they were deleting after publishing theirs (:func:`finish_aside`). Those of other hosts (a
    shared filesystem; also a host whose name extends this one's, ``gpu`` and ``gpu-12``) and of live processes
    are left alone."""
    for p in _dead_siblings(out, _build_prefix(out)):
        if is_marked(p):  # a build's record from its start: a user's folder of that shape is no leftover
            shutil.rmtree(p, ignore_errors=True)
    for p in _dead_siblings(out, aside_prefix(out)):
        finish_aside(p, out, kind)


def umask_modes(root: Path) -> None:
    """Give every regular file under ``root`` the mode a plain ``open`` would (0666 less the umask): writers that
    create their files private (safetensors' ``save_file`` makes 0600 whatever the umask) would leave a team's
    shared folder with files only their owner can read."""
    mode = 0o666 & ~umask()
    for dirpath, _, files in os.walk(root):
        for name in files:
            p = Path(dirpath) / name
            if not p.is_symlink():
                os.chmod(p, mode)


def _stamp_nested(folder: Path) -> None:
    """Stamp the files of each output nested in a write-once one that its own writer left unstamped (the factor
    store inside a PEFT import): published whole, an edit in it later is a user's, which ``--overwrite`` refuses."""
    for root, dirs, _ in os.walk(folder):
        for d in dirs:
            if listed_dir(Path(root, d)):
                stamp_listed(Path(root, d))


@contextlib.contextmanager
def building_dir(
    out: Path,
    kind: str,
    inputs: dict[str, Path | str | None] | None = None,
    error: type[Exception] | None = None,
    what: str = "--out",
) -> Iterator[Path]:
    """A fresh temporary sibling of ``out`` to fill; given a record of ``kind`` listing everything in it
    (:func:`inventory`) and published as ``out`` (:func:`publish_dir`) when the block ends normally, deleted when
    it raises. So ``out`` is either the old directory or the complete new one. An existing ``out`` is checked
    (:func:`check_replaceable` with ``kind`` and the command's ``inputs``; ``what`` names it) before anything is
    built."""
    check_replaceable(out, kind, inputs, what=what, error=error)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _sweep_dead_builds(out, kind)
        tmp = owned_sibling(out, "tmp")
        os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes it private; published, it is the umask's like any folder
    except OSError as e:
        raise FrodError(
            path_error(out, e)
            or f"cannot create a directory beside {out}: {e.strerror or e}; choose a writable location"
        ) from None
    try:
        mark_dir(tmp, kind)  # from its start: a killed build's folder is told from a user's of the same shape
        yield tmp
        umask_modes(tmp)
        _stamp_nested(tmp)
        mark_dir(tmp, kind, inventory(tmp), stamp=True)
        publish_dir(tmp, out, kind, inputs, error, what)
    except BaseException as e:
        # asked before the partial output is deleted (which frees the space): writers that report a full disk as
        # something else (safetensors' SafetensorError "No space left on device") reach the user as a full disk
        if isinstance(e, OSError) and e.errno in DISK_ERRNOS:
            disk = e
        else:
            disk = disk_full_error(tmp, e) if isinstance(e, Exception) else None
        shutil.rmtree(tmp, ignore_errors=True)
        if disk is not None:
            raise FrodError(
                f"cannot write {out}: {disk.strerror}; {disk_advice(disk)} (nothing was left behind)"
            ) from None
        raise
