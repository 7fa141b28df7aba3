"""``python tests/support/ranks.py N SCRIPT [ARGS ...]``: N ranks of SCRIPT on this host with torchrun's environment
contract (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` on a free
port), without importing torch.

The suite's multi-rank training runs use it where the launcher is not what a test is about: on 2 cores the suite is
CPU-bound and torchrun's own start-up (torch and torch.distributed.elastic, ~4 CPU-seconds) is a fifth of a tiny
2-rank run. What torchrun itself does is tested where it matters (``tests/cli/test_cli.py``'s ``torchrun -m
frod_ds.cli``, eval's two-rank run, the bench chains, srun under a real Slurm). Like torchrun: when one rank fails the
others get SIGTERM (SIGKILL 30 s later) and the exit code is the failed rank's; a signal sent to the process group
reaches every rank itself, and the launcher waits for them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo for tests.support

from tests.support.leftovers import free_port  # noqa: E402  (torch-free)


def main(argv: list[str]) -> int:
    n, cmd = int(argv[0]), argv[1:]
    port = str(free_port())
    procs = []
    for rank in range(n):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n),
               "LOCAL_WORLD_SIZE": str(n), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(subprocess.Popen([sys.executable, *cmd], env=env))
    signal.signal(signal.SIGTERM, lambda *_: None)  # the ranks got it too (process group): wait for them
    failed = None
    while any(p.poll() is None for p in procs):
        bad = [p for p in procs if p.returncode not in (None, 0)]
        if bad and failed is None:
            failed = bad[0]
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            deadline = time.monotonic() + 30
        if failed is not None and time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.05)
    failed = failed or next((p for p in procs if p.returncode != 0), None)
    if failed is None:
        return 0
    return 128 - failed.returncode if failed.returncode < 0 else failed.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
