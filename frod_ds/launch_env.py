"""What the launcher tells a process through its environment: rank, world size, local rank, ranks per node.

``torchrun`` and the ``deepspeed`` launcher set ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (and
``MASTER_ADDR``/``MASTER_PORT``); under ``srun`` the SLURM variables say the same and
:func:`srun_process_group_env` maps them onto the torch names. The process-group helpers are in
``frod_ds.distributed``; this part imports no torch, so ``launch/hjd.py`` can start reading its rank's
weights before torch is loaded.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping

__all__ = ["launcher_rank_world", "ranks_on_this_node", "first_slurm_host", "srun_process_group_env"]


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


def ranks_on_this_node(env: Mapping[str, str] | None = None) -> int:
    """How many ranks share this node's memory: torchrun's ``LOCAL_WORLD_SIZE``, srun's
    ``SLURM_STEP_TASKS_PER_NODE`` (``"8"`` or ``"8(x2)"``), else the world size, else 1."""
    env = os.environ if env is None else env
    for key in ("LOCAL_WORLD_SIZE", "SLURM_STEP_TASKS_PER_NODE", "WORLD_SIZE"):
        head = env.get(key, "").split("(")[0].split(",")[0]
        if head.isdigit() and int(head) > 0:
            return int(head)
    return 1


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list: ``"gpu[003-004,9],cpu1"`` -> ``"gpu003"``."""
    first = re.split(r",(?![^\[]*\])", nodelist)[0]
    m = re.match(r"^([^\[]*)\[([^\],-]+)", first)
    return m.group(1) + m.group(2) if m else first


def srun_process_group_env(env: MutableMapping[str, str] | None = None) -> tuple[int, int, int] | None:
    """:func:`launcher_rank_world`; under srun also sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` and (unless
    set) ``MASTER_ADDR`` (the step's first host) and ``MASTER_PORT`` (from the job id) for the process group."""
    env = os.environ if env is None else env
    launch = launcher_rank_world(env)
    if launch is not None and "RANK" not in env:  # srun
        rank, world, local = launch
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        env.setdefault("MASTER_ADDR", first_slurm_host(nodes))
        env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local))
    return launch
