"""Whether every rank of one command was started alike: the same flags, recipe, JSON and input files as rank 0.

Nodes that read different copies of a recipe or a data file, or a launcher script that passes one rank other
flags, would otherwise produce one mixed result recorded under rank 0's settings; each command compares what it
was given across ranks before it reads or writes anything, and refuses in one line naming the first differences.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from frod_ds.runtime import distributed as dist
from frod_ds.runtime.errors import FrodError

__all__ = ["Settings", "first_unlike_rank", "setting_differences", "refuse_unlike", "check_ranks_agree"]

Settings = Mapping[str, Mapping[str, Any]]  # part label ("" or "DeepSpeed ", ...) → flat key → value
SHOWN = 3  # differences named in the one line


def first_unlike_rank(mine: Any) -> tuple[int, Any, Any] | None:
    """Collective: ``None`` when every rank's ``mine`` (picklable) equals rank 0's; else the first rank that
    differs, with rank 0's value and its own."""
    everyone = dist.all_gather_object(mine)
    return next(((r, everyone[0], v) for r, v in enumerate(everyone) if v != everyone[0]), None)


def setting_differences(first: Settings, theirs: Settings, rank: int) -> list[str]:
    """``<part><key>: <rank 0's> on rank 0, <theirs> on rank <rank>`` for each key whose values differ."""
    return [
        f"{part}{k}: {first[part].get(k)!r} on rank 0, {theirs[part].get(k)!r} on rank {rank}"
        for part in first
        for k in sorted(set(first[part]) | set(theirs.get(part, {})))
        if first[part].get(k) != theirs.get(part, {}).get(k)
    ]


def refuse_unlike(diff: list[str], files: str) -> None:
    """``FrodError`` naming the first ``SHOWN`` differences, when there are any; ``files``: what a node may have
    read another copy of."""
    if diff:
        more = " …" if len(diff) > SHOWN else ""
        raise FrodError(
            f"the ranks were not started alike: {'; '.join(diff[:SHOWN])}{more}; start every rank with the same "
            f"command and the same files ({files})"
        )


def check_ranks_agree(mine: Settings, files: str) -> None:
    """Collective: ``FrodError`` on every rank unless each has rank 0's ``mine``."""
    found = first_unlike_rank({part: dict(values) for part, values in mine.items()})
    if found is not None:
        rank, first, theirs = found
        refuse_unlike(setting_differences(first, theirs, rank) or ["their settings"], files)
