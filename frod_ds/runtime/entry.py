"""How every command runs: process group, user errors as one line, bugs as tracebacks, teardown.

A command's ``main`` returns ``entry.run(lambda: work(args))``, which joins the launcher's process group and
returns the exit code: ``body``'s value (``None`` is 0); 2 for a ``FrodError``, printed once by rank 0 when every
rank knows it (``CollectiveError``), else by the rank that raised it, prefixed ``[rank r]`` among several; any
other exception is a bug and propagates (a traceback, exit 1). The process group is left in every case.
A stdout or stderr that cannot be written is the report's loss, not the output's: ``frod_ds.runtime.console``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import warnings
from collections.abc import Callable
from typing import NoReturn

from frod_ds.runtime.atomic import DISK_FULL_ERRNOS, disk_advice, disk_full_line, path_error
from frod_ds.runtime.console import Console, console_files, escape_unencodable
from frod_ds.runtime.errors import USER_ERROR, FrodError, forget_notes, last_completed

__all__ = ["USER_ERROR", "Terminated", "run", "report", "run_script"]


def _distributed():
    """``frod_ds.runtime.distributed`` once the command uses torch, else None: a command that never imports torch
    (``frod plan``, ``frod data``) has no process group to report from or leave, and starts in a fraction of a
    second instead of paying torch's import for its teardown."""
    if "torch" not in sys.modules:
        return None
    from frod_ds.runtime import distributed as D

    return D


def report(error: FrodError) -> None:
    """Print the one ``error:`` line of ``error`` where it belongs (see the module docstring)."""
    D = _distributed()
    if D is not None and isinstance(error, D.CollectiveError):
        if D.is_main():
            print(f"error: {error}", file=sys.stderr, flush=True)
        return
    where = f"[rank {D.get_rank()}] " if D is not None and D.get_world_size() > 1 else ""
    print(f"error: {where}{error}", file=sys.stderr, flush=True)


# What torch.distributed's backends say when a peer process is gone mid-collective (gloo's TCP pairs, NCCL).
PEER_LOST = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "remote process exited or there was a network error",
)
# ... and when a collective waited past the group's timeout for a rank that never came (stuck, not gone)
PEER_LATE = ("Timed out waiting", "timed out", "Watchdog caught collective operation timeout")
FAULT = 1  # the exit code of a failure that is no user error (a lost peer)


def long_name(path: str | os.PathLike | None) -> str:
    """What is too long in ``path``: its longest name when that passes the usual 255-byte limit, else the whole."""
    names = [n for n in os.fsdecode(path or "").split("/") if n]
    longest = max(names, key=lambda n: len(os.fsencode(n)), default="")
    if len(os.fsencode(longest)) > 255:
        return f"a name in this path is {len(os.fsencode(longest))} bytes long, past the file system's limit (255)"
    return "the path is longer than the file system allows"


def run(body: Callable[[], int | None], *, init_group: bool = True, backend: str | None = None) -> int:
    """Run a launch script's ``body`` (see the module docstring). ``init_group``: join the launcher's
    process group first (``distributed.init_distributed(backend)``); pass False when ``body`` sets up its
    own (training: cheap checks first, then DeepSpeed's group)."""
    try:
        if init_group:
            from frod_ds.runtime import distributed as D

            D.init_distributed(backend)
        code = body()
        return 0 if code is None else int(code)
    except FrodError as e:
        report(e)
        D = _distributed()
        if D is not None and isinstance(e, D.CollectiveError):
            D.barrier()  # rank 0 has printed before any rank leaves
        return USER_ERROR
    except OSError as e:
        # an output path below a file (``--out notes.txt/x``), wherever the command first creates it: the user's
        # path, named with the file in the way; nothing was created under it
        line = path_error(e.filename, e) if e.filename and e.errno == errno.ENOTDIR else None
        if line:
            report(FrodError(line))
            return USER_ERROR
        if e.errno == errno.ENAMETOOLONG:  # a name past the file system's limit (255 bytes), wherever it was used
            report(FrodError(f"{e.filename or 'a path'}: {long_name(e.filename)}; choose a shorter path"))
            return USER_ERROR
        if e.errno in (errno.EMFILE, errno.ENFILE):  # ``ulimit -n`` too low for the command's files and libraries
            import resource

            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            report(FrodError(f"{e.strerror} (ulimit -n is {soft}): raise the limit and re-run the same command"))
            return USER_ERROR
        if e.errno not in DISK_FULL_ERRNOS:
            raise
        done = last_completed()
        if not e.filename and done is not None:  # no file named: the command's report to stdout (> /dev/full)
            report(FrodError(f"cannot write the command's report ({e.strerror}); {_after_stop()}"))
            return USER_ERROR
        report(FrodError(disk_full_line(e)))  # a full (or read-only) disk: the user's to fix, not a traceback
        return USER_ERROR
    except RuntimeError as e:  # a collective whose peer went away: the peer's own failure is the news, not this
        D = _distributed()
        if D is None or D.get_world_size() < 2:
            raise
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
        if not any(s in str(e) for s in PEER_LOST) and any(s in str(e) for s in PEER_LATE):
            report(
                FrodError(
                    f"a collective waited {D.collective_timeout_minutes():g} minutes for another rank of this job, "
                    f"which never joined it ({first[:120]}): a rank is stuck (a hung node, a stalled file system) or "
                    f"far slower than this one; {D.COLLECTIVE_TIMEOUT_ENV} sets the wait; {_after_stop()}"
                )
            )
            return FAULT
        if not any(s in str(e) for s in PEER_LOST):
            raise
        report(
            FrodError(
                f"another rank of this job stopped, and this one lost it in a collective ({first[:160]}): the "
                f"launcher's report names that rank; {_after_stop()}"
            )
        )
        return FAULT
    finally:
        D = _distributed()
        if D is not None:
            D.destroy()


class Terminated(BaseException):  # noqa: N818 - a stop, like KeyboardInterrupt, not an error
    """SIGTERM (a scheduler's stop, ``kill``) raised where the command is, so that what it was writing is cleaned
    up and its output lease given back as after Ctrl-C; training's loop stops at a checkpoint instead."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


def _after_stop() -> str:
    """What a stop left: the command's output when it came after that was published, else the way on."""
    done = last_completed()
    if done is not None:
        return f"it came after {done} was complete: that output is whole and kept, nothing needs to run again"
    return "the same command again continues from what was finished"


def run_script(main: Callable[[], int], fast_exit: bool = False) -> NoReturn:
    """The tail of every command (``frod`` in each of its forms): run ``main`` and exit
    with its code. ``fast_exit`` (training, HJD, evaluation): flush and ``os._exit``. Their files are written
    atomically and the process group is gone by then; the interpreter's teardown only costs time (CUDA,
    page-locked memory) and, on gloo, a native thread pool left joinable at exit occasionally aborts a rank
    ("terminate called without an active exception", exit -6) after a successful run, which a scheduler would
    record as a failed job. While it runs, output its streams cannot encode is escaped (``escape_unencodable``),
    and a stream that cannot be written is dropped and named at the end (``frod_ds.runtime.console``)."""
    console = Console()
    restore = escape_unencodable()
    try:
        code, fast_exit = _exit_code(main, fast_exit)
        code = console.end(code, last_completed())
    except BaseException:  # a bug: its traceback goes to stderr; where stderr is lost, stdout says so
        console.end(1, None)
        raise
    finally:
        restore()
        console.restore()
        forget_notes()
    if not fast_exit:
        sys.exit(code)
    for stream in (sys.stdout, sys.stderr):  # None where the command was started with that stream closed (>&-)
        if stream is not None:
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
    os._exit(code)


def _exit_code(main: Callable[[], int], fast_exit: bool) -> tuple[int, bool]:
    """``main``'s exit code (``_run_main``) and whether to leave fast; argparse's exit (``--help``, a usage error)
    is its code, left the ordinary way."""
    try:
        return _run_main(main), fast_exit
    except SystemExit as stop:
        if not isinstance(stop.code, int | None):
            raise
        return stop.code or 0, False


def _flush_stdout() -> None:
    """Write out what stdout still holds, so that a report it cannot take fails here (an ``OSError``), not in the
    interpreter's teardown (its "Exception ignored" and exit 120)."""
    if sys.stdout is not None and not sys.stdout.closed:
        sys.stdout.flush()


def _written(main: Callable[[], int]) -> int:
    """``main()`` with its report written out, also when it ends in a ``SystemExit`` (argparse's ``--help``)."""
    try:
        code = main()
    except SystemExit:
        _flush_stdout()
        raise
    _flush_stdout()
    return code


def _unwritten_report(e: OSError) -> int:
    """Say in one line that stdout refused the command's report (``> /dev/full``), drop what it still buffers, and
    return the exit code."""
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the buffered rest goes nowhere at exit
    if last_completed() is not None:
        report(FrodError(f"cannot write the command's report ({e.strerror}); {_after_stop()}"))
    else:
        report(FrodError(f"cannot write the command's report to stdout: {e.strerror}; {disk_advice(e)} and re-run it"))
    return USER_ERROR


def _run_main(main: Callable[[], int]) -> int:
    """``main``'s exit code, with the stops and failures every command reports alike as one line."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # this process is the command: no library caller
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    previous = signal.getsignal(signal.SIGTERM)
    if previous == signal.SIG_DFL:  # not one a caller installed
        signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        os.getcwd()  # torch's MKL, Path.cwd() and relative paths all need it: one line, before any of them
    except FileNotFoundError:
        print(
            "error: the working directory no longer exists (deleted or moved away); cd to an existing folder and "
            "run the command again",
            file=sys.stderr,
        )
        sys.exit(USER_ERROR)
    try:
        code = _written(main)
    except ImportError as e:
        if "shared object" not in str(e) and ".so" not in str(e):
            raise  # a module of frod-ds's own, or a missing package: a bug or an install to fix, with its traceback
        # a library's compiled part that would not load (a memory limit such as ulimit -v, or a broken install)
        print(
            f"error: a library's compiled part did not load ({' '.join(str(e).split())[:200]}); raise the process's "
            "memory limit (ulimit -v) if one is set, else reinstall that package",
            file=sys.stderr,
        )
        code = USER_ERROR
    except KeyboardInterrupt:  # Ctrl-C: the user's own stop, not a bug; what is half-written is never published
        print(f"error: interrupted (Ctrl-C); {_after_stop()}", file=sys.stderr)
        code = 130
    except Terminated:
        print(f"error: stopped by SIGTERM; {_after_stop()}", file=sys.stderr)
        code = 128 + signal.SIGTERM
    except BrokenPipeError:
        if not any(f.pipe_closed for f in console_files()):
            raise  # another pipe of the command's: a bug
        # a console stream's reader went away (`frod plan | head -1`): stop quietly, as SIGPIPE would stop it
        code = 128 + signal.SIGPIPE
    except OSError as e:
        if e.filename or e.errno not in DISK_FULL_ERRNOS:
            raise
        code = _unwritten_report(e)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return code
