"""The console while a command runs: ``sys.stdout`` and ``sys.stderr`` are its report, not its product.

A stream that cannot be written (a full disk, a quota, an I/O error, a descriptor closed from the start) is dropped
and named at the end with exit 2 (``Console``); a closed console pipe stops the command as SIGPIPE would; what a
stream's encoding cannot hold is escaped (``escape_unencodable``). Used by ``frod_ds.runtime.entry.run_script``.
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import io
import os
import signal
import sys
from collections.abc import Callable

from frod_ds.runtime.errors import USER_ERROR, FrodError

__all__ = ["Console", "console_files", "escape_unencodable", "say"]


def escape_unencodable() -> Callable[[], None]:
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


class ConsoleFile(io.FileIO):
    """The descriptor under ``sys.stdout`` or ``sys.stderr`` while a command runs. A write its closed pipe refuses
    raises ``BrokenPipeError`` (the command stops, as after SIGPIPE); any other refusal (a full disk, a quota, an I/O
    error) makes it a sink: the descriptor points at /dev/null from then on (C libraries and child processes write
    nowhere too), the error is kept for the command's last line, and what it is given is dropped (its tail kept)."""

    def __init__(self, fd: int, label: str, lost: OSError | None = None, unwritable: OSError | None = None) -> None:
        super().__init__(fd, "w", closefd=False)
        self.name = f"<{label}>"
        self.label = label
        self.lost = lost
        self.unwritable = unwritable  # lost at the first write (a descriptor closed from the start)
        self.pipe_closed = False
        self.dropped = b""

    def write(self, data) -> int:  # noqa: ANN001 - a bytes-like object, as FileIO's
        view = memoryview(data)
        if self.lost is None and self.unwritable is not None and view.nbytes:
            self.lost = self.unwritable
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


def _to_devnull(fd: int, mode: int = os.O_WRONLY) -> None:
    """Point descriptor ``fd`` at /dev/null."""
    sink = os.open(os.devnull, mode)
    if sink != fd:  # fd was closed and the lowest free number: it is already there
        os.dup2(sink, fd)
        os.close(sink)


def console_files() -> list[ConsoleFile]:
    """The ``ConsoleFile`` under ``sys.stdout`` and ``sys.stderr``, where they have one (guarded)."""
    raws = [getattr(b, "raw", b) for b in (getattr(sys.stdout, "buffer", None), getattr(sys.stderr, "buffer", None))]
    return [raw for raw in raws if isinstance(raw, ConsoleFile)]


def _guarded(stream: object, label: str) -> io.TextIOWrapper | None:
    """``stream`` (the interpreter's own stdout or stderr) as a text stream over a ``ConsoleFile`` of its
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
    raw = ConsoleFile(fd, label, lost)
    buffer = io.BufferedWriter(raw) if isinstance(stream.buffer, io.BufferedWriter) else raw
    return io.TextIOWrapper(
        buffer,  # type: ignore[arg-type] - unbuffered (python -u): text straight to the descriptor, as before
        encoding=stream.encoding,
        errors=stream.errors,
        newline="\n",
        line_buffering=stream.line_buffering,
        write_through=stream.write_through,
    )


def _closed(fd: int) -> bool:
    """Whether descriptor ``fd`` is not open (``cmd >&-``, a daemon started without it)."""
    try:
        os.fstat(fd)
    except OSError as e:
        return e.errno == errno.EBADF
    return False


def _lost_from_start(label: str, fd: int) -> io.TextIOWrapper:
    """A text stream for ``label``, which the interpreter found closed (descriptor ``fd``): /dev/null is put at
    ``fd`` where it is still free (no file the command opens may take the number and be written as ``label``),
    and the stream is lost at its first write, as a full disk's would be."""
    if _closed(fd):
        _to_devnull(fd)
    else:  # something the interpreter opened took the number: left as it is
        fd = os.open(os.devnull, os.O_WRONLY)
    closed = OSError(errno.EBADF, "it was closed when the command started")
    return io.TextIOWrapper(
        io.BufferedWriter(ConsoleFile(fd, label, unwritable=closed)),
        encoding="utf-8",
        errors="backslashreplace",
        newline="\n",
    )


class Console:
    """``sys.stdout`` and ``sys.stderr`` while a command runs, each over a ``ConsoleFile``: the console is the
    command's report, not its product, so a stream that cannot be written (a full disk, a quota, an I/O error, a
    descriptor closed from the start) never stops the command nor is taken for its output's disk. The outputs are
    written whole; ``end`` then exits 2 (or the command's own non-zero code) with one ``error:`` line on the other
    stream naming the lost one; with both lost the exit status alone tells. A console pipe whose reader went away
    stops the command with 141 instead."""

    def __init__(self) -> None:
        self.saved: dict[str, object] = {}
        if _closed(0):  # no file the command opens takes descriptor 0 either
            _to_devnull(0, os.O_RDONLY)
        for fd, label in ((1, "stdout"), (2, "stderr")):
            if getattr(sys, label) is None:  # the interpreter found the descriptor closed
                self.saved[label] = None
                setattr(sys, label, _lost_from_start(label, fd))
                continue
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
        lost = [f for f in console_files() if f.lost is not None]
        if not lost or code == 128 + signal.SIGPIPE:
            return code
        line = _lost_line(lost[0], code, done)
        say(sys.stderr if lost[0].label == "stdout" else sys.stdout, line)
        return code or USER_ERROR

    def restore(self) -> None:
        """Give the caller its streams back (an in-process caller's own; a command's process is ending)."""
        for label, stream in self.saved.items():
            with contextlib.suppress(OSError, ValueError):
                getattr(sys, label).flush()
            setattr(sys, label, stream)
        self.saved.clear()


def _lost_line(file: ConsoleFile, code: int, done: str | None) -> str:
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


def say(stream: object, line: str) -> None:
    """Write ``error: line`` on ``stream`` (rank-prefixed among a launcher's several, srun's too); nothing where it
    cannot be written."""
    from frod_ds.runtime.launch_env import launcher_rank_world

    try:
        ranks = launcher_rank_world()
    except FrodError:  # variables no launcher sets: the command named them itself
        ranks = None
    where = f"[rank {ranks[0]}] " if ranks is not None and ranks[1] > 1 else ""
    with contextlib.suppress(OSError, ValueError, AttributeError):  # a lost or closed stream: the exit code tells
        print(f"error: {where}{line}", file=stream, flush=True)  # type: ignore[call-overload]
