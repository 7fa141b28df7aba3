"""A data build's records: its options (``BuildOptions``), each split as rendered (``SplitResult``) and its
``manifest.json``: sources, counts, drops and repeats per task and split, the template and, for LLM-Adapters'
files, the instruction families found (docs/data.md). The output files' sha256s are added as they are written
(``frod_ds.prep.dataset.write_outputs``)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from frod_ds.prep import llm_adapters, sources
from frod_ds.prep import rows as prep_rows
from frod_ds.prep.tasks import DEFAULT_WINOGRANDE_SIZE, LLM_ADAPTERS_ROWS

__all__ = ["FORMAT", "BuildOptions", "SplitResult", "make_manifest"]

FORMAT = "frod-ds/commonsense170k/v1"


@dataclass(frozen=True)
class BuildOptions:
    """Everything a build depends on; equal options over equal sources give identical outputs."""

    source: str
    out: Path
    tasks: tuple[str, ...]
    winogrande_size: str = DEFAULT_WINOGRANDE_SIZE
    seed: int = 42
    strict: bool = False
    tokenizer: str | None = None
    cutoff: int | None = None
    overwrite: bool = False
    template: str | None = None  # "paper" | "llm-adapters"; None: llm-adapters for an llm-adapters source, else paper
    keep_duplicates: bool = False  # keep training rows that repeat an earlier row verbatim (default: drop them)


@dataclass
class SplitResult:
    """One task split after rendering: kept output rows and dropped-row counts per reason."""

    task: str
    role: str  # "train" or "eval"
    split: str  # the source split name
    rows: list[dict[str, Any]]
    read: int
    dropped: Counter[str]
    provenance: dict[str, Any] = field(default_factory=dict)
    families: dict[str, Any] | None = None  # LLM-Adapters files: family -> {"tasks", "read", "kept"}
    not_selected: int = 0  # combined LLM-Adapters file: rows of families not selected by --tasks
    origin: str = ""  # the file (or Hub id and split) the rows were read from, for error messages
    repeated: int = 0  # rows repeating an earlier row of the split verbatim (training: dropped unless kept)


def winogrande_size_used(options: BuildOptions) -> str | None:
    """The WinoGrande size actually read: the requested one, or None for a flat local folder."""
    if "winogrande" not in options.tasks or sources.llm_adapters_path(options.source) is not None:
        return None
    if options.source == sources.HUB:
        return options.winogrande_size
    folder = sources.task_dir(Path(options.source), "winogrande", options.winogrande_size)
    return options.winogrande_size if folder.name.startswith("winogrande_") else None


def make_manifest(
    options: BuildOptions, results: list[SplitResult], n_train: int, template: str, in_training: dict[str, int]
) -> dict[str, Any]:
    """Everything about the build except the output files' sha256s (added when written); ``template``: the one
    the build rendered with, ``in_training``: per task, the test rows found in its training rows."""
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "seed": options.seed,
        "tasks": list(options.tasks),
        "winogrande_size": winogrande_size_used(options),
        "source": sources.describe_source(options.source),
        "sources": {},
        "counts": {},
        "dropped": {},
        # rows repeating an earlier row of their split verbatim, and what the build did with them
        "repeated": {
            "train": "kept" if options.keep_duplicates else "dropped",
            "eval": "kept as published",
            "rows": {},
        },
        # test rows that are also training rows of their task: kept as published, counted (row_checks)
        "test_rows_in_training": {"rows": in_training, "action": "kept as published"},
        "train_rows": n_train,
        "reference": {
            "name": "LLM-Adapters commonsense_170k",
            "rows": LLM_ADAPTERS_ROWS,
            "train_rows_minus_reference": n_train - LLM_ADAPTERS_ROWS,
        },
    }
    for r in results:
        manifest["sources"].setdefault(r.task, {})[r.role] = r.provenance
        counts = {
            "split": r.split,
            "read": r.read,
            "kept": len(r.rows),
            "dropped": r.read - len(r.rows) - r.not_selected,
        }
        if r.not_selected:
            counts["not_selected"] = r.not_selected
        manifest["counts"].setdefault(r.task, {})[r.role] = counts
        if r.dropped:
            manifest["dropped"].setdefault(r.task, {})[r.role] = dict(sorted(r.dropped.items()))
        if r.repeated:
            manifest["repeated"]["rows"].setdefault(r.task, {})[r.role] = r.repeated
    if sources.llm_adapters_path(options.source) is not None:
        manifest.update(llm_adapters_manifest(options, results, template))
    return manifest


def llm_adapters_manifest(options: BuildOptions, results: list[SplitResult], template: str) -> dict[str, Any]:
    """Manifest fields of an LLM-Adapters build: template, separator, families per file, notes."""
    families = {r.provenance["path"]: r.families for r in results}
    tasks = set(options.tasks)
    if template == "paper":
        notes = {task: note for task, note in llm_adapters.PAPER_NOTES.items() if task in tasks}
        prompts = {
            "train": "the paper's templates (frod_ds.prep.templates)",
            "eval": "the paper's templates (frod_ds.prep.templates)",
        }
    else:
        notes = {"boolq": llm_adapters.BOOLQ_NOTE_LLM_ADAPTERS} if "boolq" in tasks else {}
        prompts = {
            "train": "LLM-Adapters finetune.py generate_prompt (empty input), up to where output starts",
            "eval": "LLM-Adapters commonsense_evaluate.py generate_prompt (empty input)",
        }
    return {
        "template": template,
        "training_text": "prompt + separator + answer + EOS; "
        "separator: the row's 'separator' field, else '\\nAnswer: '",
        "separator": llm_adapters.SEPARATOR if template == "llm-adapters" else prep_rows.ANSWER_SEPARATOR,
        "prompts": prompts,
        "families": families,
        "notes": notes,
    }
