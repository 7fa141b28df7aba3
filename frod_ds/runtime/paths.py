"""What a path given on the command line is, in words, so that a wrong one gets one line naming what it is.

``file_problem`` / ``dir_problem`` say why a path is not the readable file or directory asked for (missing, a
symbolic-link loop, a broken link, a named pipe, a directory, unreadable) instead of "not found". ``folder_kind`` says
which frod-ds output or model a directory holds (from its marker, else its files) and ``wrong_folder`` turns a
directory of the wrong kind into one line saying what it is and where it goes. Torch-free.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from frod_ds.runtime.atomic import KINDS, MARKER, marker_kind

__all__ = ["FOLDERS", "file_problem", "dir_problem", "folder_kind", "describe_folder", "wrong_folder"]

# every kind of directory a command may be handed → how a message names it (frod-ds outputs: atomic.KINDS)
FOLDERS = {
    **KINDS,
    "hf-checkpoint": "a Hugging Face model checkpoint",
    "peft-adapter": "a PEFT adapter",
}
# where a directory of each kind belongs, for the message about one given in the wrong place
_GOES_TO = {
    "hf-checkpoint": "a model goes to --model, --base-model or model.base",
    "hf-export": "a merged export is a model: it goes to --model, --base-model or model.base",
    "factor-store": "a factor store goes to --factor-store or model.factor_store",
    "adapter": "an adapter goes to --checkpoint or model.init_adapter",
    "peft-adapter": "a PEFT adapter is imported with frod export --from-peft",
    "peft-export": "a PEFT adapter export loads with peft (or frod export --from-peft imports it)",
    "peft-import": "its adapter/ goes to --checkpoint",
    "data-build": "a data build goes to --data or data.train",
    "training-run": "its adapter-final/ goes to --checkpoint",
    "eval-results": "evaluation results are a report, not an input",
    "demo": "the demo's adapter is adapter-final/ in it",
}


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


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def folder_kind(path: str | os.PathLike) -> str | None:
    """The kind of directory ``path`` is (a key of ``FOLDERS``): its marker's kind, else what its files say; None
    for a directory that holds none of them (or no directory)."""
    p = Path(path)
    if not p.is_dir():
        return None
    if (p / MARKER).is_file():
        kind = marker_kind(p)
        if kind in FOLDERS:
            return kind
    adapter_config = p / "adapter_config.json"
    if adapter_config.is_file():
        return "peft-adapter" if "peft_type" in _json(adapter_config) else "adapter"
    if (p / "manifest.json").is_file():
        manifest = _json(p / "manifest.json")
        if str(manifest.get("format", "")).startswith("frod-ds/commonsense170k") or (p / "train.jsonl").is_file():
            return "data-build"
        if "categories" in manifest and "pi" in manifest:
            return "factor-store"
    if (p / "config.json").is_file() and (any(p.glob("*.safetensors")) or any(p.glob("*.bin"))):
        return "hf-checkpoint"
    if (p / "checkpoints").is_dir() or (p / "adapter-final").is_dir():
        return "training-run"
    if (p / "results.json").is_file():
        return "eval-results"
    return None


def describe_folder(path: str | os.PathLike) -> str:
    """``path`` in words: "a factor store", "an empty directory", "a directory holding no model or frod-ds output"."""
    kind = folder_kind(path)
    if kind is not None:
        return FOLDERS[kind]
    try:
        empty = not any(Path(path).iterdir())
    except OSError:
        empty = False
    return "an empty directory" if empty else "a directory holding no model or frod-ds output"


def wrong_folder(path: str | os.PathLike, flag: str, accept: Iterable[str], want: str) -> str | None:
    """One line when directory ``path`` (given as ``flag``) is a known kind not in ``accept``: what it is, what
    ``flag`` wants (``want``) and where a directory of its kind goes; None when it is of an accepted kind or of
    none this module knows (the caller's own checks then say what is missing)."""
    kind = folder_kind(path)
    if kind is None or kind in set(accept):
        return None
    return f"{f'{flag} ' if flag else ''}{path} is {FOLDERS[kind]}, not {want}; {_GOES_TO[kind]}"
