"""Stops held back over a few statements that must not be cut in half (removing a lease once its output is
published): SIGINT and SIGTERM arriving meanwhile are delivered when the block ends, to the handlers in place."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["held"]

STOPS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Defer SIGINT and SIGTERM for the block (main thread only: elsewhere Python runs no handlers anyway)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    before = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in STOPS}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        if got:
            signal.raise_signal(got[0])
