"""Reading each task's source splits: from the Hugging Face Hub or from a local mirror.

A local mirror holds one folder per task key with its split files (``DIR/boolq/train.jsonl``,
``DIR/obqa/test.parquet``, a ``save_to_disk`` folder, ...), rows in the task's Hugging Face schema; an
``llm-adapters:PATH`` source is ``commonsense_170k.json`` or a folder in the layout of LLM-Adapters' ``dataset/``
(`LLM_ADAPTERS_FOLDERS`). The accepted file kinds: docs/data.md#the-templates-and-files-in-detail.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from frod_ds.prep.tasks import TASKS, DataPrepError, hub_config
from frod_ds.runtime.paths import dir_problem, file_problem
from frod_ds.runtime.strict_json import DuplicateKeyError, parse_json

HUB = "hub"
SPLIT_SUFFIXES = (".jsonl", ".json", ".parquet")
LLM_ADAPTERS = "llm-adapters:"
# task key -> LLM-Adapters' dataset/<folder> name
LLM_ADAPTERS_FOLDERS = {
    "boolq": "boolq",
    "piqa": "piqa",
    "siqa": "social_i_qa",
    "hellaswag": "hellaswag",
    "winogrande": "winogrande",
    "obqa": "openbookqa",
    "arc_easy": "ARC-Easy",
    "arc_challenge": "ARC-Challenge",
}
LLM_ADAPTERS_SPLITS = {"train": "train", "eval": "test"}  # role -> file stem


@dataclass
class SplitData:
    """The raw rows of one split, with where they came from.

    `origin` names the source in error messages (a file path or a Hub id and split);
    `provenance` is what the manifest records about it.
    """

    rows: list[Any]
    origin: str
    provenance: dict[str, Any] = field(default_factory=dict)


def _one_line(exc: BaseException, limit: int = 300) -> str:
    """`Type: first line of the message`, for wrapping library errors into one-line messages."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- Hugging Face Hub -----------------------------------------------------------------------


def load_hub_split(task: str, split: str, winogrande_size: str) -> SplitData:
    """Load one split of `task` with `datasets.load_dataset(hub_id, config, split=split)`."""
    spec, config = TASKS[task], hub_config(task, winogrande_size)
    name = spec.hub_id + (f" ({config})" if config else "")
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - datasets is a project dependency
        raise DataPrepError(f"--source hub needs the 'datasets' package ({_one_line(exc)})") from None
    try:
        dataset = datasets.load_dataset(spec.hub_id, config, split=split)
    except Exception as exc:  # any failure to reach or parse the Hub becomes one clear line
        raise DataPrepError(
            f"cannot load {task} from the Hugging Face Hub ({name}, split {split}): {_one_line(exc)}; "
            "check network access and that HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are unset, "
            "or use --source DIR with a local mirror"
        ) from None
    provenance = {"hub_id": spec.hub_id, "config": config, "split": split}
    return SplitData(dataset.to_list(), f"{name} split {split}", provenance)


# --- local mirror ---------------------------------------------------------------------------


def task_dir(root: Path, task: str, winogrande_size: str) -> Path:
    """`root/task`, or `root/winogrande/winogrande_<size>` when that size folder exists."""
    path = root / task
    if task == "winogrande" and (path / f"winogrande_{winogrande_size}").is_dir():
        return path / f"winogrande_{winogrande_size}"
    return path


def check_local_tasks(root: Path, tasks: list[str]) -> None:
    """Raise one error naming every requested task whose subdirectory is missing."""
    if not root.is_dir():
        why = dir_problem(root) if root.exists() or root.is_symlink() else f"{root}: no such directory"
        raise DataPrepError(f"--source {why} (pass 'hub' or a local mirror directory)")
    missing = [task for task in tasks if not (root / task).is_dir()]
    if missing:
        present = [task for task in tasks if task not in missing] or [k for k in TASKS if (root / k).is_dir()]
        hint = f"; pass --tasks {','.join(present)} to build only the tasks present" if present else ""
        raise DataPrepError(
            f"source {root} has no directory for task(s) {', '.join(missing)} "
            f"(expected {', '.join(str(root / t) for t in missing)}){hint}"
        )


def find_split(directory: Path, split: str) -> Path:
    """The one file or folder holding `split` in a task directory."""
    odd = [file_problem(p) for p in (directory / f"{split}{x}" for x in SPLIT_SUFFIXES) if p.is_symlink() or p.exists()]
    if any(odd):  # a named pipe or a link loop where the split file belongs: say so, not "no split"
        raise DataPrepError(f"{split} split: {next(filter(None, odd))}")
    found = [directory / f"{split}{suffix}" for suffix in SPLIT_SUFFIXES if (directory / f"{split}{suffix}").is_file()]
    if (directory / split).is_dir():
        found.append(directory / split)
    if not found:
        raise DataPrepError(
            f"no {split} split in {directory} (expected {split}.jsonl, {split}.json, {split}.parquet "
            f"or a save_to_disk folder {split}/)"
        )
    if len(found) > 1:
        raise DataPrepError(f"{split} split in {directory} is ambiguous: {', '.join(p.name for p in found)}; keep one")
    return found[0]


def _read_json_lines(path: Path, text: str) -> list[Any]:
    rows = []
    for line_no, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            try:
                rows.append(parse_json(line))
            except json.JSONDecodeError as exc:
                raise DataPrepError(
                    f"cannot read {path}: line {line_no} is not valid JSON ({exc.msg} at column {exc.colno}); "
                    "fix or remove that line"
                ) from None
            except DuplicateKeyError as exc:  # JSON would keep the last value: which one the author meant is unknown
                raise DataPrepError(f"cannot read {path}: line {line_no}: {exc}") from None
    return rows


def _read_json(path: Path) -> list[Any]:
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")  # a leading byte-order mark (editors on Windows write one) is not a row
    except UnicodeDecodeError as exc:
        if data[:2] == b"\x1f\x8b":  # gzip's magic: a compressed file under a text file's name
            raise DataPrepError(f"cannot read {path}: it is gzip-compressed; decompress it (gunzip) first") from None
        line = data[: exc.start].count(b"\n") + 1
        raise DataPrepError(
            f"cannot read {path}: not UTF-8 text (line {line}, byte {exc.start}: 0x{data[exc.start]:02x}); "
            "save it as UTF-8"
        ) from None
    if path.suffix == ".json":  # a JSON array, a single row, or JSON lines as Dataset.to_json writes them
        try:
            value = parse_json(text)
        except json.JSONDecodeError:
            pass
        except DuplicateKeyError as exc:  # JSON keeps the last value: which one the author meant is unknown
            raise DataPrepError(
                f'cannot read {path}: an object gives key "{exc.key}" twice (JSON keeps only the last value); '
                "remove one"
            ) from None
        else:
            if isinstance(value, (list, dict)):
                return value if isinstance(value, list) else [value]
            raise DataPrepError(
                f"cannot read {path}: expected a JSON array of rows or JSON lines, got {type(value).__name__}"
            )
    return _read_json_lines(path, text)


def _read_parquet(path: Path) -> list[Any]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises several types for corrupt or non-parquet files
        raise DataPrepError(f"cannot read {path}: not a readable parquet file ({_one_line(exc)})") from None


def _read_saved_dataset(path: Path) -> list[Any]:
    import datasets

    try:
        dataset = datasets.load_from_disk(str(path))
    except Exception as exc:  # missing/corrupt arrow or state files
        raise DataPrepError(f"cannot read {path}: not a readable save_to_disk folder ({_one_line(exc)})") from None
    if not isinstance(dataset, datasets.Dataset):
        raise DataPrepError(f"cannot read {path}: it holds several splits; point at one split's folder")
    return dataset.to_list()


def read_split_file(path: Path) -> list[Any]:
    """All rows of one split file or save_to_disk folder, as Python objects."""
    try:
        if path.is_dir():
            return _read_saved_dataset(path)
        if path.suffix == ".parquet":
            return _read_parquet(path)
        return _read_json(path)
    except OSError as exc:
        raise DataPrepError(f"cannot read {path}: {exc.strerror or _one_line(exc)}") from None


def sha256_tree(path: Path) -> str:
    """sha256 of a file, or of a folder's files (relative names and contents, in sorted order)."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            digest.update(file.relative_to(path).as_posix().encode() + b"\0")
        digest.update(file.read_bytes())
    return digest.hexdigest()


def load_local_split(root: Path, task: str, split: str, winogrande_size: str) -> SplitData:
    """Read one split of `task` from a local mirror rooted at `root`."""
    path = find_split(task_dir(root, task, winogrande_size), split)
    rows = read_split_file(path)
    provenance = {"path": path.relative_to(root).as_posix(), "sha256": sha256_tree(path)}
    return SplitData(rows, str(path), provenance)


def load_split(source: str, task: str, split: str, winogrande_size: str) -> SplitData:
    """One split of `task` from `source`: "hub" or a local mirror directory."""
    if source == HUB:
        return load_hub_split(task, split, winogrande_size)
    return load_local_split(Path(source), task, split, winogrande_size)


def describe_source(source: str) -> dict[str, Any]:
    """What the manifest records about the source as a whole."""
    if source == HUB:
        return {"kind": "hub"}
    path = llm_adapters_path(source)
    if path is not None:
        layout = "combined file" if path.is_file() else "task folders"
        return {"kind": "llm-adapters", "layout": layout, "path": str(path.resolve())}
    return {"kind": "local", "root": str(Path(source).resolve())}


# --- LLM-Adapters ---------------------------------------------------------------------------


def llm_adapters_path(source: str) -> Path | None:
    """PATH of an ``llm-adapters:PATH`` source; None for any other source."""
    return Path(source[len(LLM_ADAPTERS) :]) if source.startswith(LLM_ADAPTERS) else None


def check_llm_adapters_source(path: Path, tasks: list[str]) -> None:
    """Raise one error if PATH is missing or a folder lacks a selected task's train.json/test.json."""
    if path.is_file():
        return
    if not path.is_dir():
        why = file_problem(path) if path.exists() or path.is_symlink() else f"{path}: no such file or directory"
        raise DataPrepError(
            f"--source llm-adapters:{why} (pass commonsense_170k.json or a folder of <task>/{{train,test}}.json)"
        )

    def absent(task: str) -> list[str]:  # test.json is required; train.json is optional (evaluation folders)
        if has_llm_adapters_split(path, task, "eval"):
            return []
        return [
            str(path / LLM_ADAPTERS_FOLDERS[task] / f"{stem}.json")
            for stem in LLM_ADAPTERS_SPLITS.values()
            if not (path / LLM_ADAPTERS_FOLDERS[task] / f"{stem}.json").is_file()
        ]

    missing = [f"{task} (no {' and no '.join(absent(task))})" for task in tasks if absent(task)]
    if missing:
        complete = [task for task in TASKS if not absent(task)]
        hint = f"; pass --tasks {','.join(complete)} to build only the tasks present" if complete else ""
        raise DataPrepError(f"LLM-Adapters source {path} lacks files of selected task(s): {', '.join(missing)}{hint}")


def load_llm_adapters_file(path: Path, root: Path) -> SplitData:
    """All rows of one LLM-Adapters JSON file; provenance relative to `root`."""
    rows = read_split_file(path)
    name = path.name if path == root else path.relative_to(root).as_posix()
    return SplitData(rows, str(path), {"path": name, "sha256": sha256_tree(path)})


def has_llm_adapters_split(root: Path, task: str, role: str) -> bool:
    """Whether ``root/<folder>/{train,test}.json`` of `task` exists (LLM-Adapters' evaluation folders in common
    use, ``dataset/piqa/test.json``, hold the test split only)."""
    return (root / LLM_ADAPTERS_FOLDERS[task] / f"{LLM_ADAPTERS_SPLITS[role]}.json").is_file()


def load_llm_adapters_split(root: Path, task: str, role: str) -> SplitData:
    """``root/<folder>/{train,test}.json`` of `task` (role "train" or "eval")."""
    return load_llm_adapters_file(root / LLM_ADAPTERS_FOLDERS[task] / f"{LLM_ADAPTERS_SPLITS[role]}.json", root)
