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

``run(n, cmd, env, cwd, timeout)`` is the same from inside a test, without the launcher's own interpreter: it
forks the ranks (``n == 0``: one process without launcher variables, as ``python SCRIPT``) from the calling
pytest worker, which has those imports already, and returns what ``subprocess.run(..., capture_output=True,
text=True)`` of the command line would. Each child first drops what the worker set up and a fresh interpreter
would not have (its exit handlers, signal handlers, pytest's stdio capture, log handlers and warning recorder,
torch's global defaults; see ``_as_fresh``). For runs that a test only starts and waits for; a test that signals
a run or checks the launcher starts the command line itself.
"""

from __future__ import annotations

import functools
import io
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT_PATH = list(sys.path)  # as python SCRIPT sees it, but for the first entry (the script's folder)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo for tests.support

from tests.support import pace  # noqa: E402  (torch-free)
from tests.support.leftovers import free_port  # noqa: E402  (torch-free)


def _run_rank(cmd: list[str], env: dict[str, str]) -> None:
    """In a forked child: become ``python SCRIPT ARGS`` (or ``python -m MODULE ARGS``) with ``env`` and never
    return."""
    import atexit
    import runpy

    code = 0
    try:
        os.environ.clear()
        os.environ.update(env)
        if cmd[0] == "-m":  # as python -m: the working folder first on sys.path, argv[0] the module's file
            sys.argv = [cmd[1], *cmd[2:]]
            sys.path[:] = [os.getcwd(), *SCRIPT_PATH[1:]]
            runpy.run_module(cmd[1], run_name="__main__", alter_sys=True)
        else:
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


def _start(cmd: list[str], env: dict[str, str], prepare=None):
    """One rank: a forked child of this (already imported) process, which first calls ``prepare()`` (a failure
    there ends the child with exit code 1), or a fresh interpreter."""
    if os.environ.get("FROD_RANKS_EXEC") == "1":
        return subprocess.Popen([sys.executable, *cmd], env=env)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        if prepare is not None:
            try:
                prepare()
            except BaseException:  # noqa: BLE001 - the child must not return into its parent's code
                import traceback

                traceback.print_exc()
                os._exit(1)
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


def _preimport(cmd: list[str]) -> None:
    """The imports every rank would pay (nothing started by them)."""
    import torch  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    try:
        import deepspeed  # noqa: F401

        if "--config" in cmd:  # a DeepSpeed engine: its ZeRO optimizer check imports Muon, whose @torch.compile
            # kernels import torch._inductor (~1.4 CPU-seconds per rank here, whatever the optimizer)
            import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    except ImportError:
        pass


def _rank_env(env: dict[str, str], rank: int, n: int, port: str) -> dict[str, str]:
    return {
        **env,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(n),
        "LOCAL_WORLD_SIZE": str(n),
        "GROUP_RANK": "0",
        "TORCHELASTIC_RUN_ID": "none",  # torchrun --standalone's
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
    }


def _supervise(procs: list, deadline: float | None = None) -> int | None:
    """Wait for the ranks like torchrun: when one fails the others get SIGTERM, SIGKILL 30 s later. The exit code
    (a rank killed by signal S: 128 + S), or None once ``deadline`` (time.monotonic) passes with ranks alive."""
    failed = None
    while [p for p in procs if p.poll() is None]:  # every rank polled (any() would stop at the first alive)
        if deadline is not None and time.monotonic() > deadline:
            return None
        bad = [p for p in procs if p.returncode not in (None, 0)]
        if bad and failed is None:
            failed = bad[0]
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            kill_at = time.monotonic() + 30
        if failed is not None and time.monotonic() > kill_at:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.05)
    failed = failed or next((p for p in procs if p.returncode != 0), None)
    if failed is None:
        return 0
    return 128 - failed.returncode if failed.returncode < 0 else failed.returncode


def main(argv: list[str]) -> int:
    n, cmd = int(argv[0]), argv[1:]
    port = str(free_port())
    if os.environ.get("FROD_RANKS_EXEC") != "1":
        _preimport(cmd)
    procs = [_start(cmd, _rank_env(dict(os.environ), rank, n, port)) for rank in range(n)]
    for sig in (signal.SIGTERM, signal.SIGINT):  # the ranks got it too (process group): wait for them
        signal.signal(sig, lambda *_: None)
    return _supervise(procs)


def _forkable() -> bool:
    """Whether this process can be forked into a command: no process group of its own to inherit."""
    dist = sys.modules.get("torch.distributed")
    return not (dist is not None and dist.is_available() and dist.is_initialized())


def run(n: int, cmd: list[str], env: dict[str, str], cwd: str | Path, timeout: float) -> subprocess.CompletedProcess:
    """``python tests/support/ranks.py N CMD ...`` (``n == 0``: ``python CMD ...``) with ``env`` in ``cwd``, as
    ``subprocess.run(..., capture_output=True, text=True, timeout=timeout)`` returns it, its ranks forked from this
    process (the module docstring). ``FROD_RANKS_EXEC=1``: that command line itself. ``timeout`` is the
    reference machine's (``tests.support.pace``)."""
    timeout = pace.scaled(timeout)
    argv = [sys.executable, *([str(Path(__file__).resolve()), str(n)] if n else []), *cmd]
    if os.environ.get("FROD_RANKS_EXEC") == "1" or not _forkable():
        return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    _preimport(cmd)
    port = str(free_port())
    envs = [dict(env)] if n == 0 else [_rank_env(env, rank, n, port) for rank in range(n)]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:

        def prepare(e: dict[str, str]) -> None:
            _as_fresh(out.fileno(), err.fileno(), e)
            os.chdir(cwd)

        procs = [_start(cmd, e, functools.partial(prepare, e)) for e in envs]
        code = _supervise(procs, deadline=time.monotonic() + timeout)
        if code is None:  # as torchrun stops its ranks: SIGTERM (a command's own clean-up), SIGKILL 30 s later
            for p in procs:
                p.terminate()
            if _supervise(procs, deadline=time.monotonic() + 30) is None:
                for p in procs:
                    p.kill()
            for p in procs:
                while p.poll() is None:
                    time.sleep(0.01)
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read().decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n"))
    if code is None:
        raise subprocess.TimeoutExpired(argv, timeout, output=texts[0], stderr=texts[1])
    if n == 0:
        code = procs[0].returncode  # one plain process: as subprocess reports it (killed by signal S: -S)
    return subprocess.CompletedProcess(argv, code, texts[0], texts[1])


def _showwarnmsg(msg) -> None:
    """Python's own warning printer (what ``warnings`` does when nothing records warnings)."""
    import warnings

    file = msg.file if msg.file is not None else sys.stderr
    if file is not None:
        try:
            file.write(warnings._formatwarnmsg(msg))
        except OSError:
            pass


def _as_fresh(out_fd: int, err_fd: int, env: dict[str, str]) -> None:
    """In a child forked from a pytest worker: undo what the worker set up that ``python SCRIPT`` would not have,
    with stdout/stderr going to ``out_fd``/``err_fd``."""
    import atexit
    import faulthandler
    import logging
    import threading
    import warnings

    atexit._clear()  # the worker's exit handlers (e.g. removing its cached set-ups) are not the command's
    if faulthandler.is_enabled():
        faulthandler.disable()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    old_out, old_err = (sys.stdout, sys.__stdout__), (sys.stderr, sys.__stderr__)  # held: ids must not be reused
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(open(0, "rb", closefd=False))
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(
        open(1, "wb", buffering=0 if unbuffered else -1, closefd=False), write_through=unbuffered
    )
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        open(2, "wb", buffering=0 if unbuffered else -1, closefd=False),
        errors="backslashreplace",
        line_buffering=True,
    )
    loggers = [logging.getLogger()] + [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    for lg in loggers:
        for h in list(lg.handlers):
            if type(h).__module__.startswith("_pytest"):
                lg.removeHandler(h)
            elif type(h) is logging.StreamHandler or (
                isinstance(h, logging.StreamHandler)
                and not isinstance(h, logging.FileHandler)
                and not isinstance(type(h).__dict__.get("stream"), property)
            ):
                if any(h.stream is o for o in old_out):
                    h.stream = sys.stdout
                elif any(h.stream is o for o in old_err):
                    h.stream = sys.stderr
    # pytest records warnings (and sets 'always' for deprecations) while a test runs: print them as Python does
    warnings.filters[:] = [
        f
        for f in warnings.filters
        if not (
            f[0] == "always"
            and f[1] is None
            and f[3] is None
            and f[2] in (DeprecationWarning, PendingDeprecationWarning)
        )
    ]
    warnings.showwarning = warnings._showwarning_orig
    warnings._showwarnmsg_impl = _showwarnmsg
    warnings._filters_mutated()
    threading.excepthook = threading.__excepthook__
    sys.unraisablehook = sys.__unraisablehook__
    torch = sys.modules.get("torch")
    if torch is not None:  # global defaults an earlier in-process test may have changed
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or os.cpu_count() or 1))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
