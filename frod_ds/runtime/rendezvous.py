"""Joining a process group without a silent, uninterruptible wait.

torch's rendezvous blocks in C++ until every rank has joined: Python's signal handlers do not run meanwhile, so a
process started with a stale launcher environment (``WORLD_SIZE=2`` left in a shell, no other rank ever coming)
waited without a word and ignored Ctrl-C and SIGTERM. :func:`join` runs the blocking call in a helper thread while
the main thread waits in short slices: Ctrl-C and SIGTERM act at once, rank 0 says what it is waiting for after
``NOTE_S``, and after ``JOIN_S`` every rank stops with one line saying what to do.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

from frod_ds.runtime.errors import FrodError

__all__ = ["JOIN_S", "NOTE_S", "join"]

NOTE_S = 30.0  # ranks started together join within seconds; past this rank 0 says what it waits for
JOIN_S = 600.0  # past this the other ranks are taken not to come (a multi-node start skews by a minute or two)


def join(connect: Callable[[], None], rank: int, world: int, where: str, join_s: float = JOIN_S) -> None:
    """Run ``connect`` (the blocking rendezvous of rank ``rank`` of ``world`` at ``where``) in a helper thread; its
    exception is raised here. A ``FrodError`` once ``join_s`` has passed without it returning."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            connect()
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
            outcome.append(e)

    helper = threading.Thread(target=run, name="frod-rendezvous", daemon=True)
    t0, noted = time.monotonic(), False
    helper.start()
    while helper.is_alive():
        helper.join(0.2)  # returns to Python: a signal's handler (Ctrl-C, SIGTERM) runs here
        waited = time.monotonic() - t0
        if not noted and waited > NOTE_S and helper.is_alive():
            noted = True
            print(  # every waiting rank says it (``note`` speaks for rank 0 only): a lone rank 1 waits as long
                f"note: rank {rank} of {world} has waited {waited:.0f} s for the other ranks at {where}; it stops "
                f"after {join_s:.0f} s. Without a launcher, unset WORLD_SIZE and RANK to run one process",
                file=sys.stderr,
                flush=True,
            )
        if waited > join_s and helper.is_alive():
            raise FrodError(_not_joined(rank, world, where, join_s))
    if outcome and outcome[0] is not None:
        e = outcome[0]
        said = _join_error(e, rank, world, where, time.monotonic() - t0)
        if said is not None:
            raise FrodError(said) from None
        raise e


def _join_error(e: BaseException, rank: int, world: int, where: str, waited: float) -> str | None:
    """The one line for torch's store failing the join (its wait for the other ranks, or rank 0 never reached,
    ran out; the address already taken); None for anything else."""
    name, text = type(e).__name__, str(e).lower()
    if name == "DistNetworkError" and ("address already in use" in text or "eaddrinuse" in text):
        return (
            f"rank {rank} of {world}: the rendezvous address {where} is already in use (another job, or a second "
            "rank 0: each rank needs its own RANK or SLURM_PROCID); choose another MASTER_PORT, or start the ranks "
            "with a launcher"
        )
    if (
        name == "DistNetworkError"
        and rank != 0
        and ("connection was likely closed" in text or "failed to recv" in text)
    ):
        return (
            f"rank {rank} of {world}: rank 0 at {where} closed the rendezvous before this rank joined (it gave up "
            "waiting, or the ranks were given different world sizes); start every rank with the same launcher command"
        )
    if name == "DistNetworkError" and rank != 0 and "timed out" in text:
        return (
            f"rank {rank} of {world}: rank 0 was not reached at {where} within {waited:.0f} s (it never started, "
            "failed, or listens at another address or port); start every rank with the same launcher command, or "
            "unset WORLD_SIZE and RANK (left from another job?) to run one process"
        )
    if name != "DistStoreError" or not ("timed out" in text or "timeout" in text):
        return None
    return _not_joined(rank, world, where, waited)


def _not_joined(rank: int, world: int, where: str, waited: float) -> str:
    return (
        f"rank {rank} of {world}: the other {world - 1} rank(s) did not join at {where} within {waited:.0f} s; "
        "start every rank with a launcher (torchrun, deepspeed, srun), or unset WORLD_SIZE and RANK (left from "
        "another job?) to run one process"
    )
