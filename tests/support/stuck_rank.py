"""Two ranks through ``frod_ds.runtime.entry.run``; rank 1 sleeps ``STUCK_S`` seconds (a stuck node) before the
barrier both must reach (tests/runtime/test_stuck_rank.py)."""

from __future__ import annotations

import os
import sys
import time

from frod_ds.runtime import distributed as D
from frod_ds.runtime import entry


def body() -> int:
    if D.get_rank() == 1:
        time.sleep(float(os.environ["STUCK_S"]))
    D.barrier()
    print(f"rank {D.get_rank()} passed the barrier", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(entry.run(body, backend="gloo"))
