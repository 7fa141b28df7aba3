"""A command run in a session of its own that ends, with every process it started, when its caller dies.

``python tied_session.py PID -- ARGV`` (this file as a script: it imports the standard library only) becomes a
session's leader, asks the kernel for SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG)``), runs ``ARGV``
and waits; on that SIGTERM (the caller was killed, even with ``kill -9``) it SIGKILLs every process of its session:
ninja puts each compiler in a process group of its own, but none leaves the session. ``wrapper_script`` is an
executable that runs a program that way, for a caller that starts the program by name (torch runs ``ninja``
from ``PATH``: ``frod_ds.runtime.op_build``). Linux only (``/proc``, ``prctl``).
"""

from __future__ import annotations

import ctypes
import os
import shlex
import signal
import subprocess
import sys
import time

__all__ = ["supported", "wrapper_script", "session_members", "end_session"]

_PR_SET_PDEATHSIG = 1


def supported() -> bool:
    return sys.platform.startswith("linux") and os.path.isdir("/proc/self")


def wrapper_script(program: str) -> str:
    """A ``sh`` script that runs ``program`` with its arguments in a session tied to the script's caller."""
    q = shlex.quote
    return f'#!/bin/sh\nexec {q(sys.executable)} {q(os.path.abspath(__file__))} "$PPID" -- {q(program)} "$@"\n'


def session_members(sid: int) -> list[int]:
    """Pids of the live (not zombie) processes of session ``sid`` (``/proc/<pid>/stat``)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:  # state, ppid, pgrp, session, ...
            out.append(int(name))
    return out


def end_session(tries: int = 50) -> None:
    """SIGKILL every other process of this process's session until none is left (a compiler driver may start
    one more while the others die)."""
    me, sid = os.getpid(), os.getsid(0)
    for _ in range(tries):
        others = [p for p in session_members(sid) if p != me]
        if not others:
            return
        for pid in others:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


def _lead(parent: int, argv: list[str]) -> int:
    """The session leader: tie this process to ``parent``, run ``argv``, end the session if ``parent`` dies."""

    def on_term(signum, frame):  # the parent died (PDEATHSIG) or gave up on us
        end_session()
        os._exit(128 + signum)

    if os.getsid(0) != os.getpid():
        os.setsid()  # a session of its own: what the command starts stays in it
    signal.signal(signal.SIGTERM, on_term)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # it died before the kernel was asked to tell us
        return 128 + signal.SIGTERM
    child = subprocess.Popen(argv)
    code = child.wait()
    end_session()  # what the command left running (it is done: nothing of it is needed)
    return code


def main() -> None:
    parent, sep, *argv = sys.argv[1:]
    assert sep == "--" and argv, "usage: python tied_session.py PARENT_PID -- ARGV..."
    sys.exit(_lead(int(parent), argv))


if __name__ == "__main__":
    main()
