"""What the launcher tells a process through its environment: rank, world size, local rank, ranks per node.

``torchrun`` and the ``deepspeed`` launcher set ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (and
``MASTER_ADDR``/``MASTER_PORT``); under ``srun`` the SLURM variables say the same and
:func:`process_group_spec` turns either into a rendezvous without writing to the environment. The process-group helpers
are in ``frod_ds.runtime.distributed``; this part imports no torch, so ``frod hjd`` can start reading its rank's
weights before torch is loaded.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from frod_ds.runtime.errors import FrodError

__all__ = [
    "without_launcher",
    "launcher_rank_world",
    "ranks_on_this_node",
    "first_slurm_host",
    "ProcessGroupSpec",
    "process_group_spec",
    "launcher_int",
    "shown",
]


# What torchrun and the deepspeed launcher set for the processes they start (torch's elastic agent: its store and
# group; the ranks' own rendezvous), none of which a launcher started by such a process should inherit
LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CROSS_RANK",
    "CROSS_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
)


def without_launcher(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` less the launcher's variables (``TORCHELASTIC_*`` and :data:`LAUNCHER_VARS`): the environment for a
    launcher that a launched process starts (``frod demo``'s stages under an outer ``torchrun``), whose ranks would
    otherwise join the outer agent's store, which nobody hosts for them."""
    return {k: v for k, v in env.items() if k not in LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")}


def launcher_int(text: str) -> int | None:
    """``text`` as a launcher writes a count, rank, port or job id (ASCII digits, at most 18), else None:
    ``str.isdigit`` also accepts ``'²'``, which ``int`` refuses, and ``int`` refuses a value of thousands of digits."""
    return int(text) if text.isascii() and text.isdecimal() and len(text) <= 18 else None


def shown(text: str) -> str:
    """``text`` quoted for an error line, cut short when it is long (a variable may hold thousands of digits)."""
    return repr(text) if len(text) <= 40 else f"{text[:20]!r}... ({len(text)} characters)"


def launcher_rank_world(env: Mapping[str, str] | None = None) -> tuple[int, int, int] | None:
    """``(rank, world_size, local_rank)`` that torchrun / the deepspeed launcher / srun set, or ``None``.

    Under srun, ``SLURM_STEP_NUM_TASKS`` (not ``SLURM_NTASKS``), so that a plain ``python`` inside an sbatch
    script with ``--ntasks 8`` stays a single process.
    """
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return _checked(env, "RANK", "WORLD_SIZE", "LOCAL_RANK")
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        return _checked(env, "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID")
    return None


def _checked(env: Mapping[str, str], rank: str, world: str, local: str) -> tuple[int, int, int]:
    """The three values as integers, or a ``FrodError`` naming what no launcher sets (a stale or hand-set shell)."""
    raw = {k: env.get(k, "0" if k == local else "").strip() for k in (rank, world, local)}
    bad = [f"{k}={shown(v)}" for k, v in raw.items() if launcher_int(v) is None]
    if not bad:
        r, w, lr = (int(raw[k]) for k in (rank, world, local))
        if w >= 1 and r < w:
            return r, w, lr
        bad = [f"{rank}={r} with {world}={w}"]
    raise FrodError(
        f"the launcher environment is not one a launcher sets ({', '.join(bad)}): start the ranks with torchrun, "
        f"deepspeed or srun, or unset {rank} and {world} to run one process"
    )


def ranks_on_this_node(env: Mapping[str, str] | None = None) -> int:
    """How many ranks share this node's memory: torchrun's ``LOCAL_WORLD_SIZE``, srun's
    ``SLURM_STEP_TASKS_PER_NODE`` (``"8"`` or ``"8(x2)"``), else the world size, else 1."""
    env = os.environ if env is None else env
    for key in ("LOCAL_WORLD_SIZE", "SLURM_STEP_TASKS_PER_NODE", "WORLD_SIZE"):
        count = launcher_int(env.get(key, "").split("(")[0].split(",")[0])
        if count:
            return count
    return 1


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list: ``"gpu[003-004,9],cpu1"`` -> ``"gpu003"``."""
    first = re.split(r",(?![^\[]*\])", nodelist)[0]
    m = re.match(r"^([^\[]*)\[([^\],-]+)", first)
    return m.group(1) + m.group(2) if m else first


@dataclass(frozen=True)
class ProcessGroupSpec:
    """Where this process sits in a launched job, and how its process group is reached.

    ``init_method`` is ``"env://"`` under torchrun / the deepspeed launcher (they export ``MASTER_ADDR`` and
    ``MASTER_PORT``); under srun it is ``tcp://HOST:PORT`` built from the SLURM variables, so nothing needs to
    be written into the environment; ``None`` for a one-process group made without a launcher (an in-process
    store, no port).
    """

    rank: int
    world_size: int
    local_rank: int
    init_method: str | None


def process_group_spec(env: Mapping[str, str] | None = None) -> ProcessGroupSpec | None:
    """The launcher's description of this process (:func:`launcher_rank_world`), or ``None`` for one process.

    Under srun the rendezvous is ``MASTER_ADDR``/``MASTER_PORT`` when the batch script exports them, else the
    step's first host and a port derived from the job id. The environment is only read.
    """
    env = os.environ if env is None else env
    launch = launcher_rank_world(env)
    if launch is None:
        return None
    rank, world, local = launch
    port = env.get("MASTER_PORT", "").strip()
    if port and not 0 < (launcher_int(port) or 0) < 65536:
        raise FrodError(f"MASTER_PORT={shown(port)} is no TCP port (1-65535): set it to a free port, or unset it")
    if "RANK" in env:  # torchrun / the deepspeed launcher
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not env.get(k, "").strip()]
        if missing and world == 1:  # nobody to meet: one process, as without a launcher
            return ProcessGroupSpec(rank, world, local, None)
        if missing:
            raise FrodError(
                f"RANK={rank} and WORLD_SIZE={world} are set but {' and '.join(missing)} not: start the ranks "
                "with torchrun, deepspeed or srun, or unset RANK and WORLD_SIZE to run one process"
            )
        return ProcessGroupSpec(rank, world, local, "env://")
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
    addr = env.get("MASTER_ADDR") or first_slurm_host(nodes)
    job = env.get("SLURM_JOB_ID", "0").strip() or "0"
    if not port and launcher_int(job) is None:
        raise FrodError(
            f"SLURM_JOB_ID={shown(job)} is no job number (Slurm sets digits), and the rendezvous port is derived "
            "from it: export MASTER_PORT (a free TCP port) for the ranks, or unset SLURM_JOB_ID"
        )
    port = port or str(20000 + int(job) % 20000)
    return ProcessGroupSpec(rank, world, local, f"tcp://{addr}:{port}")
