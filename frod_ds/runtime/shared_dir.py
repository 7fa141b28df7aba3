"""Whether every rank sees the same directory: a file rank 0 writes to an output must be visible to all ranks.

Collectives through ``frod_ds.runtime.distributed``; one process is a no-op."""

from __future__ import annotations

import secrets
import socket
from pathlib import Path

from frod_ds.runtime.distributed import CollectiveError, all_gather_object, broadcast_object, get_world_size, is_main

__all__ = ["check_shared_dir"]


def check_shared_dir(path: Path, what: str) -> None:
    """Collective: ``CollectiveError`` on every rank unless all ranks see the same directory ``path`` (or, while it
    does not exist yet, its nearest existing parent on rank 0): a file rank 0 writes there must be visible to each. A
    node-local path (``/dev/shm``, ``/tmp`` on most clusters) is a different directory on each node; without this
    check each node would write its own part of a store or checkpoint there and rank 0 would seal an incomplete one."""
    if get_world_size() == 1:
        return
    probe, error = None, None
    if is_main():
        where = path  # not created yet (nothing is created before the run starts): its nearest existing parent,
        while not where.is_dir() and where != where.parent:  # where it will be created
            where = where.parent
        probe = where / f".frod-shared-{secrets.token_hex(8)}"
        try:
            probe.write_text(probe.name)
        except OSError as e:
            error = f"{what} {path} is not writable on rank 0 ({e.strerror or e})"
    probe, error = broadcast_object((probe, error))
    if error:
        raise CollectiveError(error)
    try:
        seen = probe.read_text() == probe.name
    except OSError:
        seen = False
    views = all_gather_object((seen, socket.gethostname()))
    if is_main():
        probe.unlink(missing_ok=True)
    blind = sorted({host for ok, host in views if not ok})
    if blind:
        raise CollectiveError(
            f"{what} {path} is not shared between the job's nodes: {', '.join(blind)} cannot see "
            "what rank 0 writes there (a node-local path such as /dev/shm?); put it on a "
            "filesystem every node mounts"
        )
