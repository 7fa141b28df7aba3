"""One optimizer step under Python's cProfile on every rank (``train.profile_step``): where the host's time goes,
including the time it waits on the device and on the other ranks, per function; each rank writes
``profile/step-<k>.rank<r>.txt`` in the run's folder.

cProfile times only the main thread's Python and the C functions it calls, and slows Python-heavy code more than
kernels or the CPU optimizer's C++ loop: the step it profiles is not a timing. The file says how long it took.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import os
import pstats
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from frod_ds.runtime.atomic import atomic_write_text
from frod_ds.runtime.errors import note
from frod_ds.runtime.paths import replaceable_own

__all__ = ["PROFILE_DIR", "profile_path", "profiled"]

PROFILE_DIR = "profile"
TOP = 60  # functions listed per ordering
ENGINE_CALLS = r"runtime/engine\.py:\d+\((forward|backward|step)\)"  # DeepSpeed's engine, as pstats names them


def profile_path(out: Path, step: int, rank: int) -> Path:
    return out / PROFILE_DIR / f"step-{step:06d}.rank{rank}.txt"


def _short(text: str) -> str:
    """File names as a package-relative path (site-packages and the interpreter's library folders dropped)."""
    for root in sorted({p for p in sys.path if p and os.path.isabs(p)}, key=len, reverse=True):
        text = text.replace(root.rstrip("/") + "/", "")
    return text


@contextlib.contextmanager
def profiled(out: Path, step: int, rank: int, on: bool) -> Iterator[None]:
    """Run the body under cProfile when ``on`` and write this rank's summary for optimizer step ``step``
    (1-based): the wall seconds, the top functions by cumulative and by own time, then the engine's three calls."""
    if not on:
        yield
        return
    prof, t0 = cProfile.Profile(), time.perf_counter()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
    wall = time.perf_counter() - t0
    buf = io.StringIO()
    buf.write(f"rank {rank}, optimizer step {step}: {wall:.3f} s wall under cProfile\n")
    for order in ("cumulative", "tottime"):
        buf.write(f"\n=== top {TOP} by {order} ===\n")
        pstats.Stats(prof, stream=buf).sort_stats(order).print_stats(TOP)
    # the step's three phases, listed whatever the ranking: waits on other ranks can push them out of the top
    buf.write("\n=== the engine's forward, backward and step ===\n")
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(ENGINE_CALLS)
    path = profile_path(out, step, rank)
    if not _ours(path, rank, step):
        note(f"{path} is not a profile this run wrote: left as it is, step {step}'s profile not written")
        return
    path.parent.mkdir(exist_ok=True)
    atomic_write_text(path, _short(buf.getvalue()))


def _ours(path: Path, rank: int, step: int) -> bool:
    """Whether ``path`` is absent or a profile of this rank and step (an earlier attempt's): nothing else is
    replaced."""
    return replaceable_own(path, lambda head: head.startswith(f"rank {rank}, optimizer step {step}: ".encode()))
