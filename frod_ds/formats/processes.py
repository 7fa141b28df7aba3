"""What Linux's /proc says of a process: whether it runs, when it started, its parent; torch-free (the leases and
the sweeps of dead writers' folders ask it)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["boot_id", "pid_alive", "pid_start", "proc_stat"]


def boot_id() -> str | None:
    """This boot's id (Linux): a pid recorded under another boot is no process now."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def proc_stat(pid: int) -> list[str]:
    """``/proc/<pid>/stat``'s fields after the command name (state, ppid, …); [] where there is none (not Linux,
    or the process is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def pid_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot; Linux), so that a reused pid is not its holder."""
    try:
        return int(proc_stat(pid)[19])
    except (IndexError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs: a zombie (killed, not yet reaped by its parent) answers ``kill(pid, 0)``
    but can write nothing more."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: past any pid (a garbled lease)
        return False
    except PermissionError:  # alive, another user's
        return True
    return proc_stat(pid)[:1] not in (["Z"], ["X"])  # no /proc to ask (not Linux): kill's answer stands
