"""Task registry for Commonsense170K: task keys, Hub sources and evaluation splits.

Commonsense170K (LLM-Adapters, Hu et al. 2023) is the union of the *training* splits of eight
commonsense tasks. Each task is evaluated on its validation split, except OBQA and ARC, whose
labelled test splits are the standard evaluation sets.
"""

from __future__ import annotations

from dataclasses import dataclass

from frod_ds.runtime.errors import FrodError


class DataPrepError(FrodError):
    """A user-facing data-prep failure; the message is one line saying what to change."""


@dataclass(frozen=True)
class TaskSpec:
    """Where a task comes from and which split is its evaluation set."""

    key: str
    hub_id: str
    hub_config: str | None
    eval_split: str


# Canonical order: the mixture is built in this order before shuffling, so it never depends on
# the order of `--tasks`.
TASKS: dict[str, TaskSpec] = {
    spec.key: spec
    for spec in (
        TaskSpec("boolq", "google/boolq", None, "validation"),
        TaskSpec("piqa", "baber/piqa", None, "validation"),
        TaskSpec("siqa", "lighteval/siqa", None, "validation"),
        TaskSpec("hellaswag", "Rowan/hellaswag", None, "validation"),
        TaskSpec("winogrande", "allenai/winogrande", "winogrande_{size}", "validation"),
        TaskSpec("obqa", "allenai/openbookqa", "main", "test"),
        TaskSpec("arc_easy", "allenai/ai2_arc", "ARC-Easy", "test"),
        TaskSpec("arc_challenge", "allenai/ai2_arc", "ARC-Challenge", "test"),
    )
}

WINOGRANDE_SIZES = ("xs", "s", "m", "l", "xl", "debiased")
DEFAULT_WINOGRANDE_SIZE = "l"  # the paper's winogrande_l

# Row count of LLM-Adapters' commonsense_170k.json, the mixture the paper fine-tunes on.
LLM_ADAPTERS_ROWS = 170_420


def hub_config(task: str, winogrande_size: str) -> str | None:
    """The `datasets` config name of `task`, e.g. `winogrande_l` for WinoGrande at size `l`."""
    config = TASKS[task].hub_config
    return None if config is None else config.format(size=winogrande_size)


def parse_tasks(spec: str) -> list[str]:
    """Parse `--tasks` ("all" or a comma list) into task keys in canonical order."""
    names = [name.strip() for name in spec.split(",")]
    if not any(names):
        raise DataPrepError("--tasks is empty; pass 'all' or a comma list of " + ", ".join(TASKS))
    if not all(names):  # "boolq,,piqa": a name left out by mistake, not to be guessed
        raise DataPrepError(
            f"--tasks {spec!r} has an empty name between commas; pass 'all' or a comma list of " + ", ".join(TASKS)
        )
    if names == ["all"]:
        return list(TASKS)
    if "all" in names:  # "all,boolq": every task, or a list? neither guessed
        raise DataPrepError(f"--tasks {spec!r}: 'all' stands alone; pass --tasks all, or a comma list of tasks")
    unknown = [name for name in names if name not in TASKS]
    if unknown:
        raise DataPrepError(
            f"unknown task {', '.join(repr(n) for n in unknown)}; valid tasks: {', '.join(TASKS)} (or 'all')"
        )
    return [key for key in TASKS if key in names]


def check_winogrande_size(size: str) -> str:
    """Return `size` if it is a WinoGrande config size, else raise DataPrepError."""
    if size not in WINOGRANDE_SIZES:
        raise DataPrepError(f"unknown WinoGrande size {size!r}; choose one of {', '.join(WINOGRANDE_SIZES)}")
    return size
