"""The machine's pace: how much slower than the idle 2-core machine the suite's time limits are set for.

The limits (120 s a test, the tests' own subprocess time-outs and "within 60 s" windows) are wall times on that
machine. A CI machine that runs at a third of its speed would fail every long test without anything being wrong,
so the limits are scaled by the pace, measured once per run before any test starts: the seconds two fresh
interpreters at once take to import torch, transformers and DeepSpeed (what most of a tiny run's time is), against
``REFERENCE_S`` there. Wall seconds, not CPU seconds: a host that loses time to its neighbours or its file system
is as slow. The pace is never below 1 (a faster machine keeps the limits as they are) and is capped, so a grossly
slow test still fails.
A test past its limit at that pace is judged again at the pace measured when it ended, the higher of the two:
a shared host slows down and speeds up again within a run. ``FROD_TEST_PACE`` sets it instead of measuring (``1``:
the limits as written, never measured again)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

REFERENCE_S = 7.0  # the probe's seconds on the idle 2-core machine, one per core (docs/testing.md)
MAX_PACE = 6.0
PROBE = "import torch, transformers, deepspeed"
PARALLEL = 2  # one probe per core of the 2-core machine
ENV = "FROD_TEST_PACE"
MEASURED = "FROD_TEST_PACE_MEASURED"  # ENV's value when the run measured it (one given differs: it is final)


def measure(env: dict[str, str]) -> float:
    """The wall seconds of ``PARALLEL`` fresh interpreters running the probe at once with ``env``: the suite runs
    several processes on its cores, and a host whose cores share one another's time is as slow as they are."""
    t0 = time.monotonic()
    procs = [
        subprocess.Popen([sys.executable, "-c", PROBE], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for _ in range(PARALLEL)
    ]
    errors = [p.communicate(timeout=600)[1] for p in procs]
    seconds = time.monotonic() - t0
    for p, err in zip(procs, errors):
        if p.returncode != 0:
            raise RuntimeError(f"the pace probe ({PROBE!r}) failed with exit {p.returncode}: {err[-500:]!r}")
    return seconds


def from_probe(seconds: float) -> float:
    """The pace that probe time gives: its ratio to the reference, within [1, MAX_PACE]."""
    return min(MAX_PACE, max(1.0, seconds / REFERENCE_S))


def parse(value: str) -> float:
    """``FROD_TEST_PACE``'s value: a number ≥ 1."""
    try:
        pace = float(value)
    except ValueError:
        pace = float("nan")
    if not pace >= 1.0:
        raise ValueError(f"{ENV}={value!r}: use a number of at least 1 (1: the time limits as written)")
    return pace


def factor() -> float:
    """This run's pace (set by ``tests/conftest.py`` before any test runs; 1 outside a test run)."""
    value = os.environ.get(ENV)
    return parse(value) if value else 1.0


def scaled(seconds: float) -> float:
    """A time limit written for the reference machine, on this one."""
    return seconds * factor()
