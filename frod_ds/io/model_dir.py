"""Where a model's folder and its ``config.json`` are found and checked, before any weight is read: a local
checkpoint directory (refused, naming what it is, when it is another kind of frod-ds folder) or a Hugging Face Hub
id (the weights from the Hub or its local cache; the planner's config from the cache only)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from frod_ds.formats.folders import wrong_folder
from frod_ds.io.model_config import config_problems
from frod_ds.runtime.errors import CheckpointError
from frod_ds.runtime.paths import dir_problem, expand_home, file_problem
from frod_ds.runtime.strict_json import DuplicateKeyError, parse_json

__all__ = [
    "HUB_PATTERNS",
    "MODEL_KINDS",
    "check_config_file",
    "check_model_folder",
    "index_weight_map",
    "resolve_config_file",
    "resolve_model_dir",
]

HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model"]
MODEL_KINDS = ("hf-checkpoint", "hf-export", "gguf-conversion")  # folders.folder_kind of a folder a model loads from
INDEX_NAME = "model.safetensors.index.json"
# rope types transformers 5 builds (modeling_rope_utils.ROPE_INIT_FUNCTIONS and "default"); another is looked up there
KNOWN_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional")


def check_model_folder(path: Path, flag: str = "--model") -> None:
    """``CheckpointError`` (one line) when ``path`` is a directory of another kind (a factor store, an adapter,
    a data build, ...): what it is and where it goes, before a reader fails on a file it lacks."""
    problem = wrong_folder(path, flag, MODEL_KINDS, "a model checkpoint (config.json + *.safetensors)")
    if problem:
        raise CheckpointError(problem)


def index_weight_map(path: Path) -> dict[str, str] | None:
    """The sharded checkpoint's ``weight_map`` (tensor name -> shard file name), checked: an object of names to
    ``*.safetensors`` file names inside the folder, each shard present. None without an index. ``CheckpointError``
    (one line, naming the index and the entry) otherwise: transformers and the readers would fail on it mid-load."""
    index = Path(path) / INDEX_NAME
    if not os.path.lexists(index):
        return None
    bad = file_problem(index)
    if bad:
        raise CheckpointError(f"{INDEX_NAME}: {bad}; copy it again from the original checkpoint")
    try:
        doc = parse_json(index.read_text())
    except (json.JSONDecodeError, DuplicateKeyError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{index} is not valid JSON ({e}); copy it again from the original checkpoint") from None
    wmap = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wmap, dict):
        raise CheckpointError(
            f"{index} has no weight_map object (tensor name -> shard file); copy it again from the original checkpoint"
        )
    if not wmap:
        raise CheckpointError(
            f"{index} maps no tensor (an empty weight_map); copy it again from the original checkpoint"
        )
    if doc.get("metadata") is not None and not isinstance(doc["metadata"], dict):
        raise CheckpointError(
            f"{index}: its metadata is a JSON {type(doc['metadata']).__name__}, not an object; copy it again from the "
            "original checkpoint"
        )
    for name, shard in wmap.items():
        plain = isinstance(shard, str) and shard == Path(shard).name and shard.endswith(".safetensors")
        if not plain:
            raise CheckpointError(
                f"{index} maps {name!r} to {json.dumps(shard)}, not a shard file name in the folder "
                "(*.safetensors); copy the index again from the original checkpoint"
            )
    for shard in sorted(set(wmap.values())):
        if not (Path(path) / shard).is_file():
            raise CheckpointError(
                f"{index} names the shard {shard}, which {path} does not hold; download or copy the checkpoint again"
            )
    return wmap


def resolve_model_dir(model: str, flag: str = "--model") -> Path:
    """A local checkpoint directory as is; otherwise a Hugging Face Hub id, downloaded (or found in the
    local HF cache) with ``snapshot_download`` — only configs, safetensors and tokenizer files. ``flag``: how
    messages name the argument."""
    path = expand_home(model)
    if path.is_dir():
        check_model_folder(path, flag)
        return path
    if os.path.lexists(path):  # a file, a named pipe, a broken link or a link loop: say which
        raise CheckpointError(
            f"{flag} {dir_problem(path)}; pass the checkpoint directory (config.json + *.safetensors)"
        )
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise CheckpointError(
            f"model directory {model!r} does not exist; pass a local checkpoint directory or a Hub id"
        )
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, allow_patterns=HUB_PATTERNS))
    except (OSError, ValueError) as e:  # offline, no network, unknown or gated repo (HTTP errors are OSErrors)
        raise CheckpointError(
            f"could not resolve {model!r}: it is not a local directory and the Hugging Face Hub id could not be "
            f"resolved (offline, or not in the local cache; "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
            "pass a local directory holding the checkpoint (config.json + *.safetensors)"
        ) from None


def resolve_config_file(model: str) -> Path:
    """``config.json`` of a local checkpoint directory, or of a Hub id from the local HF cache only (nothing is
    downloaded: the memory planner reads no weights). ``CheckpointError`` (one line) when there is none."""
    path = expand_home(model)
    if path.is_dir():
        check_model_folder(path)
        config = path / "config.json"
        problem = file_problem(config) if os.path.lexists(config) else None  # a folder, pipe or broken link
        if problem:
            raise CheckpointError(f"{problem}; copy config.json from the original checkpoint")
        if not config.is_file():
            raise CheckpointError(
                f"model directory {path} has no config.json; pass the checkpoint directory (config.json + "
                "*.safetensors)"
            )
        return path / "config.json"
    if os.path.lexists(path) or model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise CheckpointError(
            f"--model {dir_problem(path) or model}: not a checkpoint directory; pass a directory holding config.json "
            "or a Hub id in the local cache"
        )
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(model, "config.json", local_files_only=True))
    except Exception as e:  # not cached, malformed id: the same advice
        raise CheckpointError(
            f"{model!r} is not a local directory and its config.json is not in the local Hugging Face "
            f"cache ({type(e).__name__}); pass a local checkpoint directory"
        ) from None


def check_config_file(model_dir: str | os.PathLike) -> dict:
    """A local checkpoint directory's ``config.json``, checked to be a JSON object; ``CheckpointError`` (one line)
    otherwise. HJD reads only the weights, so a checkpoint without a config decomposes; the commands that build the
    model (train, eval, export) check it first instead of failing inside transformers."""
    path = resolve_config_file(str(model_dir))
    try:
        data = parse_json(path.read_text())
    except DuplicateKeyError as e:  # transformers would build the model from the last value, silently
        raise CheckpointError(f"{path}: {e}; the checkpoint's config is damaged or hand-edited") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"{path} is not valid JSON ({e}); the checkpoint's config is damaged: copy config.json "
            "from the original checkpoint"
        ) from None
    if not isinstance(data, dict):
        raise CheckpointError(
            f"{path} holds a JSON {type(data).__name__}, not a model config; copy config.json from "
            "the original checkpoint"
        )
    problems = config_problems(data) + _rope_problems(data)
    if problems:
        raise CheckpointError(
            f"{path}: {'; '.join(problems)}; no model has these values: copy config.json from the original checkpoint"
        )
    return data


def _rope_problems(cfg: dict) -> list[str]:
    """A rope type (``rope_parameters`` or ``rope_scaling``) the installed transformers does not know: it would fail
    with a KeyError when it builds the model."""
    out = []
    for key in ("rope_parameters", "rope_scaling"):
        rope = cfg.get(key)
        if not isinstance(rope, dict):
            continue
        kind = rope.get("rope_type", rope.get("type"))
        if kind is None or kind in KNOWN_ROPE_TYPES:  # the planner stays torch-free on every sound config
            continue
        if not isinstance(kind, str):
            out.append(f"{key}.rope_type must be a name, got {kind!r}")
            continue
        try:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        except ImportError:  # another transformers: it checks for itself
            return []
        if kind not in ROPE_INIT_FUNCTIONS:
            known = ", ".join(["default", *sorted(ROPE_INIT_FUNCTIONS)])
            out.append(f"{key}.rope_type {kind!r} is none transformers knows ({known})")
    return out
