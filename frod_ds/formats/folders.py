"""Which kind of folder a directory is, so that one given in the wrong place gets one line naming what it is.

``folder_kind`` says which frod-ds output or model a directory holds (from its ownership record, else its files)
and ``wrong_folder`` turns a directory of the wrong kind into one line saying what it is and where it goes
(a factor store given as ``--model``, a training run as ``--checkpoint``, ...). Torch-free.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from frod_ds.formats.output_dir import KINDS, MARKER, read_record
from frod_ds.runtime.strict_json import loads

__all__ = ["FOLDERS", "folder_kind", "describe_folder", "wrong_folder"]

# every kind of directory a command may be handed → how a message names it (frod-ds outputs: output_dir.KINDS)
FOLDERS = {
    **KINDS,
    "hf-checkpoint": "a Hugging Face model checkpoint",
    "peft-adapter": "a PEFT adapter",
}
# where a directory of each kind belongs, for the message about one given in the wrong place
_GOES_TO = {
    "hf-checkpoint": "a model goes to --model, --base-model or model.base",
    "hf-export": "a merged export is a model: it goes to --model, --base-model or model.base",
    "gguf-conversion": "a converted GGUF model is a model: it goes to --model, --base-model or model.base",
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


def _json(path: Path) -> dict:
    try:
        data = loads(path.read_text(encoding="utf-8"))
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
        record = read_record(p)
        kind = record.kind if record is not None else None
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
