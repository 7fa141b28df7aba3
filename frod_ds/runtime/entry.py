"""How every command runs: process group, user errors as one line, bugs as tracebacks, teardown.

A command's ``main`` returns ``entry.run(lambda: work(args))``, which joins the launcher's process group and
returns the exit code: ``body``'s value (``None`` is 0); 2 for a ``FrodError``, printed once by rank 0 when every
rank knows it (``CollectiveError``), else by the rank that raised it, prefixed ``[rank r]`` among several; any
other exception is a bug and propagates (a traceback, exit 1). The process group is left in every case.
A stdout or stderr that cannot be written (a full disk) is the report's loss, not the output's: ``_Console``.
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import io
import os
import signal
import sys
import warnings
from collections.abc import Callable
from typing import NoReturn

from frod_ds.runtime.atomic import DISK_FULL_ERRNOS, disk_advice, disk_full_line, path_error
from frod_ds.runtime.errors import FrodError, forget_notes, last_completed

__all__ = ["USER_ERROR", "Terminated", "run", "report", "run_script"]

USER_ERROR = 2  # exit status of a user mistake


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


def _escape_unencodable() -> Callable[[], None]:
    """Let ``sys.stdout`` and ``sys.stderr`` write what their encoding cannot hold as escapes (``\\u03c3``)
    instead of raising ``UnicodeEncodeError`` once the command's work is done (an ASCII locale,
    ``PYTHONIOENCODING=ascii``, a path that is no UTF-8); returns what puts their error handlers back."""
    changed: list[tuple[io.TextIOWrapper, str]] = []
    for stream in (sys.stdout, sys.stderr):
        if not isinstance(stream, io.TextIOWrapper) or stream.errors not in ("strict", "surrogateescape"):
            continue
        if stream.errors == "surrogateescape" and codecs.lookup(stream.encoding).name == "utf-8":
            continue  # every character is written, and bytes no UTF-8 as they were read
        errors = stream.errors
        with contextlib.suppress(OSError, ValueError):  # a closed stream, or pending output a full disk refuses
            stream.reconfigure(errors="backslashreplace")
            changed.append((stream, errors))
    return lambda: _set_errors(changed)


def _set_errors(streams: list[tuple[io.TextIOWrapper, str]]) -> None:
    """Give each stream its error handler back (kept as it is where its pending output cannot be written)."""
    for stream, errors in streams:
        with contextlib.suppress(OSError, ValueError):
            stream.reconfigure(errors=errors)


_KEPT = 4096  # bytes of what a lost stream was given, kept for the error line it held


class _ConsoleFile(io.FileIO):
    """The descriptor under ``sys.stdout`` or ``sys.stderr`` while a command runs. A write its closed pipe refuses
    raises ``BrokenPipeError`` (the command stops, as after SIGPIPE); any other refusal (a full disk, a quota, an I/O
    error) makes it a sink: the descriptor points at /dev/null from then on (C libraries and child processes write
    nowhere too), the error is kept for the command's last line, and what it is given is dropped (its tail kept)."""

    def __init__(self, fd: int, label: str, lost: OSError | None = None) -> None:
        super().__init__(fd, "w", closefd=False)
        self.name = f"<{label}>"
        self.label = label
        self.lost = lost
        self.pipe_closed = False
        self.dropped = b""

    def write(self, data) -> int:  # noqa: ANN001 - a bytes-like object, as FileIO's
        view = memoryview(data)
        if self.lost is None:
            try:
                return super().write(view)
            except BrokenPipeError:
                self.pipe_closed = True
                _to_devnull(self.fileno())  # what is still buffered goes nowhere at exit
                raise
            except OSError as e:
                self.lost = e
                _to_devnull(self.fileno())
        self.dropped = (self.dropped + view[-_KEPT:].tobytes())[-_KEPT:]
        return view.nbytes


def _to_devnull(fd: int) -> None:
    """Point descriptor ``fd`` at /dev/null."""
    sink = os.open(os.devnull, os.O_WRONLY)
    os.dup2(sink, fd)
    os.close(sink)


def _console_files() -> list[_ConsoleFile]:
    """The ``_ConsoleFile`` under ``sys.stdout`` and ``sys.stderr``, where they have one (guarded)."""
    raws = [getattr(b, "raw", b) for b in (getattr(sys.stdout, "buffer", None), getattr(sys.stderr, "buffer", None))]
    return [raw for raw in raws if isinstance(raw, _ConsoleFile)]


def _guarded(stream: object, label: str) -> io.TextIOWrapper | None:
    """``stream`` (the interpreter's own stdout or stderr) as a text stream over a ``_ConsoleFile`` of its
    descriptor, with its encoding and buffering; None for anything else (closed, a test's capture, a caller's)."""
    if type(stream) is not io.TextIOWrapper:
        return None
    try:
        fd = stream.fileno()
    except (OSError, ValueError):
        return None
    lost = None
    try:
        stream.flush()
    except BrokenPipeError:
        pass  # the next write says so
    except OSError as e:
        lost = e
        _to_devnull(fd)
    raw = _ConsoleFile(fd, label, lost)
    buffer = io.BufferedWriter(raw) if isinstance(stream.buffer, io.BufferedWriter) else raw
    return io.TextIOWrapper(
        buffer,  # type: ignore[arg-type] - unbuffered (python -u): text straight to the descriptor, as before
        encoding=stream.encoding,
        errors=stream.errors,
        newline="\n",
        line_buffering=stream.line_buffering,
        write_through=stream.write_through,
    )


class _Console:
    """``sys.stdout`` and ``sys.stderr`` while a command runs, each over a ``_ConsoleFile``: the console is the
    command's report, not its product, so a stream that cannot be written (a full disk, a quota, an I/O error) never
    stops the command nor is taken for its output's disk. The outputs are written whole; ``end`` then exits 2 (or
    the command's own non-zero code) with one ``error:`` line on the other stream naming the lost one; with both
    lost the exit status alone tells. A console pipe whose reader went away stops the command with 141 instead."""

    def __init__(self) -> None:
        self.saved: dict[str, object] = {}
        for label in ("stdout", "stderr"):
            guarded = _guarded(getattr(sys, label), label)
            if guarded is not None:
                self.saved[label] = getattr(sys, label)
                setattr(sys, label, guarded)

    def end(self, code: int, done: str | None) -> int:
        """The exit code of a command that ended with ``code``, having published ``done`` (its flag and path, or
        None): ``code``, or 2 where it is 0 and a stream was lost, which one ``error:`` line on the other says."""
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError, AttributeError):
                stream.flush()  # what is still buffered is written now, or its stream is lost now
        lost = [f for f in _console_files() if f.lost is not None]
        if not lost or code == 128 + signal.SIGPIPE:
            return code
        line = _lost_line(lost[0], code, done)
        _say(sys.stderr if lost[0].label == "stdout" else sys.stdout, line)
        return code or USER_ERROR

    def restore(self) -> None:
        """Give the caller its streams back (an in-process caller's own; a command's process is ending)."""
        for label, stream in self.saved.items():
            with contextlib.suppress(OSError, ValueError):
                getattr(sys, label).flush()
            setattr(sys, label, stream)
        self.saved.clear()


def _lost_line(file: _ConsoleFile, code: int, done: str | None) -> str:
    """The one line for ``file``'s stream, lost in a command that ended with ``code`` having published ``done``."""
    e = file.lost or OSError()
    head = f"cannot write to {file.label} ({e.strerror or e})"
    if code and file.label == "stderr":  # the command's own error line went there: it is repeated here
        said = _last_error(file.dropped)
        return f"{head}; the command failed (exit {code})" + (f": {said}" if said else "")
    if code:
        return f"{head}; what the command printed there is lost"
    if done is not None:
        return f"{head}: {done} is complete and kept, nothing needs to run again; only what it printed there is lost"
    if file.label == "stderr":
        return f"{head}: the command's report on stdout is complete; only its notes on stderr are lost"
    # the report is the command's product (plan, --help, data show)
    full = e.errno in (errno.ENOSPC, errno.EDQUOT)
    way = "free space on the disk stdout goes to (or send stdout elsewhere)" if full else "send stdout elsewhere"
    return f"cannot write the command's report to stdout: {e.strerror or e}; {way} and re-run the command"


def _last_error(dropped: bytes) -> str | None:
    """The text of the last ``error:`` line in ``dropped`` (what a lost stderr was given), None when none."""
    lines = [line for line in dropped.decode("utf-8", "replace").splitlines() if "error: " in line]
    return lines[-1].split("error: ", 1)[1].strip() if lines else None


def _say(stream: object, line: str) -> None:
    """Write ``error: line`` on ``stream`` (rank-prefixed among several); nothing where it cannot be written."""
    where = f"[rank {os.environ.get('RANK', '0')}] " if os.environ.get("WORLD_SIZE", "1") not in ("", "1") else ""
    with contextlib.suppress(OSError, ValueError, AttributeError):  # a lost or closed stream: the exit code tells
        print(f"error: {where}{line}", file=stream, flush=True)  # type: ignore[call-overload]


def run_script(main: Callable[[], int], fast_exit: bool = False) -> NoReturn:
    """The tail of every command (``frod`` in each of its forms): run ``main`` and exit
    with its code. ``fast_exit`` (training, HJD, evaluation): flush and ``os._exit``. Their files are written
    atomically and the process group is gone by then; the interpreter's teardown only costs time (CUDA,
    page-locked memory) and, on gloo, a native thread pool left joinable at exit occasionally aborts a rank
    ("terminate called without an active exception", exit -6) after a successful run, which a scheduler would
    record as a failed job. While it runs, output its streams cannot encode is escaped (``_escape_unencodable``),
    and a stream that cannot be written is dropped and named at the end (``_Console``, the module docstring)."""
    console = _Console()
    restore = _escape_unencodable()
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
        if not any(f.pipe_closed for f in _console_files()):
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
