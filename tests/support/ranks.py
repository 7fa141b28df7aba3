"""``python tests/support/ranks.py N SCRIPT [ARGS ...]``: N ranks of SCRIPT on this host with torchrun's environment
contract (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` on a free
port), the imports paid once.

The suite's multi-rank training runs use it where the launcher is not what a test is about: on 2 cores the suite is
CPU-bound, and a tiny rank spends most of its CPU importing torch, transformers and DeepSpeed (~7 CPU-seconds). This
launcher imports them once, then forks one child per rank, which sets its environment and runs SCRIPT as ``python
SCRIPT`` would (``__main__``, ``sys.argv``, the script's folder first on ``sys.path``): what a rank does after its
imports is the same, and no process group, thread or file exists before the fork. What a real launcher does is
tested where it matters (``tests/cli/test_cli.py``'s ``torchrun -m frod_ds.cli``, eval's two-rank run, the bench
chains, srun under a real Slurm). Like torchrun: when one rank fails the others get SIGTERM (SIGKILL 30 s later) and
the exit code is the failed rank's; a signal sent to the process group reaches every rank itself, and the launcher
waits for them. ``FROD_RANKS_EXEC=1``: a fresh interpreter per rank instead (no shared imports).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SCRIPT_PATH = list(sys.path)  # as python SCRIPT sees it, but for the first entry (the script's folder)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo for tests.support

from tests.support.leftovers import free_port  # noqa: E402  (torch-free)


def _run_rank(cmd: list[str], env: dict[str, str]) -> None:
    """In a forked child: become ``python SCRIPT ARGS`` with ``env`` and never return."""
    import atexit
    import runpy

    code = 0
    try:
        os.environ.clear()
        os.environ.update(env)
        script = os.path.abspath(cmd[0])
        sys.argv = [cmd[0], *cmd[1:]]
        sys.path[:] = [os.path.dirname(script), *SCRIPT_PATH[1:]]
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the rank's traceback, as the interpreter would print it
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _start(cmd: list[str], env: dict[str, str]):
    """One rank: a forked child of this (already imported) process, or a fresh interpreter."""
    if os.environ.get("FROD_RANKS_EXEC") == "1":
        return subprocess.Popen([sys.executable, *cmd], env=env)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _run_rank(cmd, env)
    return _Child(pid)


class _Child:
    """The part of ``Popen`` this launcher uses, for a forked rank."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


def main(argv: list[str]) -> int:
    n, cmd = int(argv[0]), argv[1:]
    port = str(free_port())
    if os.environ.get("FROD_RANKS_EXEC") != "1":
        import torch  # noqa: F401  (the imports every rank would pay; nothing started)
        import transformers.models.llama.modeling_llama  # noqa: F401
        try:
            import deepspeed  # noqa: F401

            if "--config" in cmd:  # a DeepSpeed engine: its ZeRO optimizer check imports Muon, whose @torch.compile
                # kernels import torch._inductor (~9 CPU-seconds per rank here, whatever the optimizer)
                import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
        except ImportError:
            pass
    procs = []
    for rank in range(n):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n),
               "LOCAL_WORLD_SIZE": str(n), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(_start(cmd, env))
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
