"""Which weights the HJD stage decomposes and which rank owns which: pure helpers that import no torch.

``frod hjd`` calls :func:`start_readahead` before it imports torch, so the kernel is already reading
this rank's first weights from disk while the interpreter loads torch and CUDA (seconds on a cold start).
:func:`plan_categories` checks the targeted weights from the shard headers alone.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from frod_ds.core.names import DEFAULT_TARGETS
from frod_ds.formats.factor_store import category_of
from frod_ds.runtime.errors import FrodError, HJDError
from frod_ds.runtime.launch_env import launcher_rank_world, ranks_on_this_node
from frod_ds.runtime.validate import widths_problem

if TYPE_CHECKING:
    from frod_ds.io.hf_checkpoint import HFCheckpoint

__all__ = [
    "DEFAULT_TARGETS",
    "FLOAT_CODES",
    "natural_key",
    "targeted_members",
    "plan_categories",
    "split_counts",
    "my_members",
    "readahead_budget",
    "start_readahead",
]

FLOAT_CODES = ("F64", "F32", "F16", "BF16")  # safetensors dtypes HJD reads


def natural_key(name: str) -> list[Any]:
    """``layers.10`` after ``layers.9``: digit runs compare as integers."""
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", name)]


def targeted_members(keys: Iterable[str], targets: Sequence[str]) -> dict[str, list[str]]:
    """``{target: [module, ...]}``: modules ``<path>.<target>`` that have a ``.weight``, in layer order."""
    found: dict[str, list[str]] = {t: [] for t in targets}
    for key in keys:
        if key.endswith(".weight"):
            module = key[: -len(".weight")]
            if category_of(module) in found:
                found[category_of(module)].append(module)
    for members in found.values():
        members.sort(key=natural_key)
    return found


def plan_categories(ckpt: HFCheckpoint, targets: Sequence[str]) -> dict[str, list[str]]:
    """``{target: [member, ...]}`` from the checkpoint's tensor names, members in layer order.

    A member is a module ``<path>.<target>`` with a 2-D floating ``<path>.<target>.weight``; all members
    of a category share the input width and the dtype. Reads shard headers only (and so reports missing or
    truncated shards holding targeted weights).
    """
    found = targeted_members(ckpt.keys(), targets)
    missing = [t for t, members in found.items() if not members]
    if missing:
        leaves = sorted({category_of(k[: -len(".weight")]) for k in ckpt.keys() if k.endswith(".weight")})
        raise HJDError(
            f"no weight '<module>.{missing[0]}.weight' in {ckpt.dir} for --targets {missing}; the checkpoint's "
            f"weight names end in: {', '.join(leaves[:24])}"
        )
    for category, members in found.items():
        infos = [(m, ckpt.info(m + ".weight")) for m in members]
        for m, info in infos:
            if len(info.shape) != 2:
                raise HJDError(f"{m}.weight has shape {list(info.shape)}; HJD targets 2-D linear weights")
            if info.code not in FLOAT_CODES:
                raise HJDError(
                    f"{m}.weight has dtype {info.code}; HJD needs bf16/fp16/fp32/fp64 weights (dequantize first)"
                )
        problem = widths_problem([info.shape[1] for _, info in infos], f"category {category!r}")
        if problem:
            raise HJDError(problem)
        codes = sorted({info.code for _, info in infos})
        if len(codes) > 1:
            raise HJDError(f"category {category!r} mixes dtypes {codes}; convert the checkpoint to one dtype")
    return found


def split_counts(n_items: int, parts: int) -> list[int]:
    """Contiguous split sizes, ``numpy.array_split`` style: the first ``n_items % parts`` get one more."""
    return [n_items // parts + (1 if p < n_items % parts else 0) for p in range(parts)]


def my_members(members: Sequence[str], rank: int, world: int) -> list[str]:
    """Rank ``rank``'s contiguous share of ``members``."""
    counts = split_counts(len(members), world)
    first = sum(counts[:rank])
    return list(members[first : first + counts[rank]])


def readahead_budget() -> float:
    """This rank's part of a quarter of the memory free now: what the page cache can take without pushing
    anything out, shared by the ranks of the node."""
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0.0
    return free / 4 / ranks_on_this_node()


def start_readahead(model: str, targets: Sequence[str], budget_bytes: float) -> threading.Thread | None:
    """Start the kernel reading this rank's targeted weights, category by category, into the page cache.

    Only for a local checkpoint directory; anything unexpected (a Hub id, a broken index) returns ``None``
    and leaves the reporting to the stage itself.
    """
    from frod_ds.io.hf_checkpoint import HFCheckpoint

    try:
        if not os.path.isdir(model):
            return None
        rank, world, _ = launcher_rank_world() or (0, 1, 0)
        ckpt = HFCheckpoint(model)
        names = [
            m + ".weight"
            for members in targeted_members(ckpt.keys(), targets).values()
            for m in my_members(members, rank, world)
        ]
        return ckpt.readahead(names, budget_bytes)
    except (OSError, FrodError):
        return None
