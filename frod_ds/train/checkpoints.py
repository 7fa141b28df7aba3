"""A training run's ``checkpoints/`` directory: sealed checkpoints, and the choice of the one to resume.

A checkpoint is sealed by its ``COMPLETE`` file (``Seal``: size and sha256 of every other file, written last).
A run resumes from the newest sealed checkpoint whose files still match their seal (``choose_checkpoint``); one
that does not is skipped with one ``note:`` and set aside as ``skipped-<tag>/``. Layout and older versions:
docs/formats.md (Engine checkpoints); what a damaged one does: docs/failure-policy.md. Every ``.pt`` file is also
loaded (tensors memory-mapped) the way the resume loads it, ``weights_only`` with DeepSpeed's few classes allowed
(``frod_ds.io.torch_pickle``): a file naming anything else is never unpickled.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from frod_ds.formats.output_dir import STEP_ENGINE_FILES
from frod_ds.formats.records import parse_json, record_from_dict, record_to_json
from frod_ds.runtime.atomic import TMP, atomic_write_text, fsync_dir
from frod_ds.runtime.errors import FrodError

__all__ = [
    "COMPLETE",
    "LATEST",
    "SEAL_FORMAT",
    "FileSeal",
    "Seal",
    "ResumeError",
    "tag_of",
    "step_of",
    "file_seal",
    "files_to_seal",
    "write_seal",
    "check_sealed",
    "sealed_checkpoints",
    "unsealed_checkpoints",
    "choose_checkpoint",
    "set_aside",
    "ROOT_FILES",
    "check_root_files",
    "detach_root_files",
    "foreign_files",
]

COMPLETE = "COMPLETE"
LATEST = "latest_complete"
# What is written into the checkpoints folder itself at every save: frod-ds's pointer, and DeepSpeed's own
# (``latest``, its recovery scripts), which DeepSpeed writes through whatever is at that path
ROOT_FILES = (LATEST, "latest", "zero_to_fp32.py", "zero_to_torch.py")
SEAL_FORMAT = "frod-ds/checkpoint-seal/v1"
_TAG = re.compile(r"step(\d{8})")


class ResumeError(FrodError):
    """``output_dir`` holds checkpoints but none of them can be resumed."""


@dataclass
class FileSeal:
    bytes: int
    sha256: str


@dataclass
class Seal:
    """``COMPLETE``: every file of the checkpoint (path relative to it) with its size and sha256."""

    format: str
    files: dict[str, FileSeal] = field(default_factory=dict)


def tag_of(step: int) -> str:
    return f"step{step:08d}"


def step_of(tag: str) -> int | None:
    m = _TAG.fullmatch(tag)
    return int(m.group(1)) if m else None


def file_seal(path: Path, fsync: bool = True) -> FileSeal:
    """Size and sha256 of ``path`` (fsynced first, so that the seal never outlives the bytes it describes)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if fsync:
            os.fsync(f.fileno())
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return FileSeal(path.stat().st_size, h.hexdigest())


def files_to_seal(ckpt: Path) -> list[str]:
    """Every file of a checkpoint but its seal, relative to it, sorted (the same list on every rank)."""
    return sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.name != COMPLETE)


def write_seal(ckpt: Path, files: dict[str, FileSeal]) -> None:
    """Write ``COMPLETE`` last (atomically), after syncing the checkpoint's directories."""
    for d in sorted({(ckpt / name).parent for name in files}, key=lambda p: len(p.parts), reverse=True):
        fsync_dir(d)
    atomic_write_text(ckpt / COMPLETE, record_to_json(Seal(SEAL_FORMAT, dict(sorted(files.items())))))


def _unloadable(ckpt: Path) -> str | None:
    """Why a ``.pt`` file of ``ckpt`` cannot be loaded safely (the first one), or None."""
    from frod_ds.io.torch_pickle import unloadable

    return next(filter(None, map(unloadable, sorted(ckpt.rglob("*.pt")))), None)


def _legacy_check(ckpt: Path) -> str | None:
    """An empty ``COMPLETE`` (older frod-ds): every ``.pt`` file must load."""
    if not any(ckpt.rglob("*.pt")):
        return "it holds no engine files"
    return _unloadable(ckpt)


def check_sealed(ckpt: Path) -> str | None:
    """Why the sealed checkpoint ``ckpt`` cannot be resumed from, or None when every file matches its seal."""
    text = (ckpt / COMPLETE).read_text()
    if not text.strip():
        return _legacy_check(ckpt)
    try:
        seal = record_from_dict(Seal, parse_json(text, ckpt / COMPLETE, FrodError), str(ckpt / COMPLETE), FrodError)
    except FrodError:
        return f"its {COMPLETE} record is corrupt"
    for name, want in seal.files.items():
        p = ckpt / name
        if not p.is_file():
            return f"{name} is missing"
        size = p.stat().st_size
        if size != want.bytes:
            return (
                f"{name} is truncated ({size} of {want.bytes} bytes)"
                if size < want.bytes
                else f"{name} has {size} bytes, not the {want.bytes} written"
            )
        if file_seal(p, fsync=False).sha256 != want.sha256:
            return f"{name} is corrupt (its sha256 differs from the one recorded when it was written)"
    return _unloadable(ckpt)


def _checkpoint_dirs(root: Path) -> list[Path]:
    """The checkpoint directories (``step<N>``) in ``root``, sealed or not, oldest first."""
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and step_of(p.name) is not None]
    return sorted(dirs, key=lambda p: step_of(p.name))  # type: ignore[arg-type, return-value]


def sealed_checkpoints(root: Path) -> list[str]:
    """Tags of the sealed checkpoints in ``root``, newest first."""
    return [p.name for p in reversed(_checkpoint_dirs(root)) if (p / COMPLETE).is_file()]


def unsealed_checkpoints(root: Path) -> list[str]:
    """Tags of the checkpoints in ``root`` without a ``COMPLETE`` seal (saves that never finished), oldest first:
    never resumed from; a save of the same step replaces one."""
    return [p.name for p in _checkpoint_dirs(root) if not (p / COMPLETE).exists()]


def choose_checkpoint(root: Path) -> tuple[str | None, list[tuple[str, str]]]:
    """``(tag, skipped)``: the newest sealed checkpoint in ``root`` whose files match their seal (None when
    there is no sealed checkpoint), and the newer ones skipped with why. ``ResumeError`` when there are sealed
    checkpoints but none can be resumed from."""
    skipped = []
    for tag in sealed_checkpoints(root):
        why = check_sealed(root / tag)
        if why is None:
            return tag, skipped
        skipped.append((tag, why))
    if skipped:
        out = root.parent
        raise ResumeError(
            f"no checkpoint in {root} can be resumed ({'; '.join(f'{t}: {w}' for t, w in skipped)}); "
            "to start this "
            f"run over, remove {root}, or pass train.new_run=true to move the run in {out} aside and start anew"
        )
    return None, []


def set_aside(root: Path, tag: str) -> Path:
    """Rename a skipped checkpoint to ``skipped-<tag>`` (never deleted: it may be wanted for inspection)."""
    dest = root / f"skipped-{tag}"
    n = 1
    while dest.exists():
        n += 1
        dest = root / f"skipped-{tag}-{n}"
    os.rename(root / tag, dest)
    return dest


def detach_root_files(root: Path) -> None:
    """Before a save: drop this folder's name of each file DeepSpeed rewrites in place (``latest``, its recovery
    scripts) that has another name too (a hard link: a backup by ``cp -al``, or a user's file), so the save writes a
    file of its own; the other name and its content are untouched. ``latest_complete`` is replaced by a rename."""
    for name in ROOT_FILES:
        path = root / name
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(path)
            if name != LATEST and stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                os.unlink(path)


def check_root_files(root: Path) -> None:
    """``FrodError`` when a file a save writes into checkpoints folder ``root`` is there as something else: a
    symbolic link (a save would write through it, into a file the run never wrote), a folder, a pipe; or when a
    checkpoint's name (``step<N>``) is not a folder (a link there would be taken for a save and replaced)."""
    for path in sorted(root.iterdir()) if root.is_dir() else []:  # before the first save: nothing there yet
        if step_of(path.name) is not None and (path.is_symlink() or not path.is_dir()):
            it = f"a symbolic link to {os.readlink(path)}" if path.is_symlink() else "not a folder"
            raise FrodError(
                f"{path} is {it}, where the run keeps a checkpoint of its own; move it away (the run's checkpoints "
                "beside it are untouched) and run the same command again"
            )
    for name in ROOT_FILES:  # DeepSpeed writes these in place: through a link (a second name: detach_root_files)
        path = root / name
        if not os.path.lexists(path):
            continue
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            it = f"a symbolic link to {os.readlink(path)}"
        elif not stat.S_ISREG(st.st_mode):
            it = "not a regular file"
        else:
            continue
        raise FrodError(
            f"{path} is {it}, where every checkpoint save writes its own {name}; remove it (the run's "
            "checkpoints beside it are untouched) and run the same command again"
        )


def foreign_files(ckpt: Path, own_names: tuple[str, ...]) -> list[str]:
    """Files under the step folder ``ckpt`` that no save writes (the engine's and RNG files by their names,
    ``own_names``, ``COMPLETE`` and their temporaries, all at its top), or ``ckpt`` itself when it is a link or no
    folder: a user's folder of a step's name is then no checkpoint of the run's, never to be deleted with the run's
    leftovers or old checkpoints."""
    if ckpt.is_symlink() or not ckpt.is_dir():
        return [ckpt.name]
    names = (COMPLETE, *own_names)
    out = []
    for p in sorted(ckpt.rglob("*")):
        rel = str(p.relative_to(ckpt))
        base = rel.removesuffix(TMP)
        ours = "/" not in base and (base in names or any(fnmatch.fnmatchcase(base, n) for n in STEP_ENGINE_FILES))
        if p.is_symlink() or (p.is_file() and not ours):
            out.append(rel)
    return out
