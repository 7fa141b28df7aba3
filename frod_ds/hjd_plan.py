"""Which weights the HJD stage decomposes and which rank owns which: pure helpers that import no torch.

``launch/hjd.py`` calls :func:`start_readahead` before it imports torch, so the kernel is already reading
this rank's first weights from disk while the interpreter loads torch and CUDA (seconds on a cold start).
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["DEFAULT_TARGETS", "natural_key", "targeted_members", "split_counts", "my_members", "launcher_rank_world",
           "start_readahead"]

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj")


def natural_key(name: str) -> list[Any]:
    """``layers.10`` after ``layers.9``: digit runs compare as integers."""
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", name)]


def targeted_members(keys: Iterable[str], targets: Sequence[str]) -> dict[str, list[str]]:
    """``{target: [module, ...]}``: modules ``<path>.<target>`` that have a ``.weight``, in layer order."""
    found: dict[str, list[str]] = {t: [] for t in targets}
    for key in keys:
        if key.endswith(".weight"):
            module = key[: -len(".weight")]
            leaf = module.rsplit(".", 1)[-1]
            if leaf in found:
                found[leaf].append(module)
    for members in found.values():
        members.sort(key=natural_key)
    return found


def split_counts(n_items: int, parts: int) -> list[int]:
    """Contiguous split sizes, ``numpy.array_split`` style: the first ``n_items % parts`` get one more."""
    return [n_items // parts + (1 if p < n_items % parts else 0) for p in range(parts)]


def my_members(members: Sequence[str], rank: int, world: int) -> list[str]:
    """Rank ``rank``'s contiguous share of ``members``."""
    counts = split_counts(len(members), world)
    first = sum(counts[:rank])
    return list(members[first : first + counts[rank]])


def launcher_rank_world(env: Mapping[str, str] | None = None) -> tuple[int, int, int] | None:
    """``(rank, world_size, local_rank)`` that torchrun / the deepspeed launcher / srun set, or ``None``.

    Under srun, ``SLURM_STEP_NUM_TASKS`` (not ``SLURM_NTASKS``), so that a plain ``python`` inside an sbatch
    script with ``--ntasks 8`` stays a single process.
    """
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        return int(env["SLURM_PROCID"]), int(env["SLURM_STEP_NUM_TASKS"]), int(env.get("SLURM_LOCALID", 0))
    return None


def start_readahead(model: str, targets: Sequence[str], budget_bytes: float) -> threading.Thread | None:
    """Start the kernel reading this rank's targeted weights, category by category, into the page cache.

    Only for a local checkpoint directory; anything unexpected (a Hub id, a broken index) returns ``None``
    and leaves the reporting to the stage itself.
    """
    from frod_ds.hf_checkpoint import HFCheckpoint

    try:
        if not os.path.isdir(model):
            return None
        rank, world, _ = launcher_rank_world() or (0, 1, 0)
        ckpt = HFCheckpoint(model)
        names = [m + ".weight" for members in targeted_members(ckpt.keys(), targets).values()
                 for m in my_members(members, rank, world)]
        return ckpt.readahead(names, budget_bytes)
    except (OSError, ValueError):
        return None
