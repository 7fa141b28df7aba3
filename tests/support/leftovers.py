"""Process-wide state a test may leave behind, and the clean environment for the processes tests start.

A test that leaves launcher variables in ``os.environ``, a live ``torch.distributed`` process group, or a
listening socket in the pytest process makes later tests order-dependent: a subprocess that inherits
``RANK``/``MASTER_PORT`` believes it is rank 0 of a launched job and listens on a port something else may
hold. ``tests/conftest.py`` checks these after every test; :func:`clean_env` is the environment every test
subprocess starts from.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# What torchrun, the deepspeed launcher, torchelastic and srun tell a process about its place in a job.
LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CROSS_RANK",
    "CROSS_SIZE",
    "LOCAL_SIZE",
)
LAUNCHER_PREFIXES = ("SLURM_", "TORCHELASTIC_", "OMPI_COMM_WORLD_", "PMI_")


def is_launcher_var(name: str) -> bool:
    return name in LAUNCHER_VARS or name.startswith(LAUNCHER_PREFIXES)


def launcher_vars(env: Mapping[str, str] | None = None) -> dict[str, str]:
    env = os.environ if env is None else env
    return {k: v for k, v in env.items() if is_launcher_var(k)}


def clean_env(**overrides: str) -> dict[str, str]:
    """This process's environment without any launcher variable, with the settings every CPU test run uses
    (one OpenMP thread, DeepSpeed on the CPU, no GPU, no hub), then ``overrides``."""
    env = {k: v for k, v in os.environ.items() if not is_launcher_var(k)}
    env.update(
        OMP_NUM_THREADS="1",
        DS_ACCELERATOR="cpu",
        CUDA_VISIBLE_DEVICES="",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=str(REPO),
        TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions")),
    )
    env.update(overrides)
    return env


def free_port() -> int:
    """A TCP port nothing on 127.0.0.1 listens on now (the kernel's choice of an ephemeral port)."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (all bound at once before any is released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def listening_sockets() -> set[str]:
    """``address:port`` of every TCP socket this process holds open in the listening state (Linux)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: TCP_LISTEN
                addr, port = fields[1].rsplit(":", 1)
                found.add(f"{table.rsplit('/', 1)[1]}:{int(port, 16)}")
    return found
