"""DeepSpeed's JIT-built ops, built once and never left locked: the ops a training launch builds (``cpu_adam``
under optimizer offload) go through :func:`load_op`.

A build killed mid-way leaves torch's lock file behind (every later launch waits forever) and its compilers
running, and a different ``ninja`` on ``PATH`` recompiles the op. :func:`load_op` builds under an ``fcntl`` lock
(the kernel drops it with its holder), deletes a baton left by a dead builder, and always runs the ninja beside
this Python if there is one, in a session that dies with this process (``PATH`` changed only during the build).
Details: docs/failure-policy.md#deepspeeds-jit-built-ops.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from frod_ds.runtime import tied_session
from frod_ds.runtime.atomic import atomic_write_text
from frod_ds.runtime.errors import FrodError, note

__all__ = [
    "BATON",
    "extensions_dir",
    "ninja_dir",
    "baton_owners",
    "clear_stale_baton",
    "wait_for_baton",
    "build_lock",
    "tied_ninja",
    "load_op",
]

BATON = "lock"  # torch.utils.file_baton.FileBaton's file in each extension's build directory
_GUARD = ".frod-ds-build.lock"  # our fcntl lock beside it
_BIN = ".frod-ds-bin"  # beside it: the ninja wrapper of tied_ninja


def extensions_dir() -> Path:
    """Where torch JIT-builds extensions (``torch.utils.cpp_extension._get_build_directory``'s root)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    accel = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
    return Path(get_default_build_root()) / f"py{sys.version_info.major}{sys.version_info.minor}_{accel}"


def ninja_dir() -> str | None:
    """The directory of the ninja every build uses: beside this interpreter (a venv's ``ninja`` wheel) when
    present, else the first on ``PATH``; None when there is none (torch then reports it)."""
    here = Path(sys.executable).parent / "ninja"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here.parent)
    found = shutil.which("ninja")
    return str(Path(found).parent) if found else None


def baton_owners(baton: Path) -> list[int]:
    """Pids of live processes holding ``baton`` open. torch's builder keeps the baton's descriptor open from
    creating it to deleting it, so a baton nobody holds open was left by a process that died (Linux /proc)."""
    target = os.path.realpath(baton)
    owners = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    owners.append(int(pid))
                    break
            except OSError:
                continue
    return owners


def clear_stale_baton(build_dir: Path) -> bool:
    """Delete ``build_dir``'s baton when no live process holds it (see :func:`baton_owners`); True if deleted."""
    baton = build_dir / BATON
    if not baton.exists() or not Path("/proc/self/fd").is_dir() or baton_owners(baton):
        return False
    with contextlib.suppress(FileNotFoundError):
        baton.unlink()
    note(f"removed {baton}, a build lock left by a process that died mid-build")
    return True


def wait_for_baton(build_dir: Path, poll_s: float = 0.5) -> None:
    """Return once ``build_dir`` holds no baton: wait while a live process builds there (any builder, frod-ds or
    not), and clear the baton as soon as its owner is dead, also when it dies during the wait (torch's own wait
    would spin on it forever)."""
    baton, waited, told = build_dir / BATON, 0.0, False
    while baton.exists():
        if clear_stale_baton(build_dir):
            return
        if waited > 10 and not told:
            note(f"waiting for process(es) {baton_owners(baton)} building in {build_dir}")
            told = True
        time.sleep(poll_s)
        waited += poll_s


@contextlib.contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """Hold an exclusive ``fcntl`` lock on ``build_dir`` for the block; the kernel releases it when the holder
    exits however it exits. Inside it, no baton is left (:func:`wait_for_baton`) before the block starts."""
    build_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(build_dir / _GUARD, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another launch builds here: say so, then wait for it
            note(f"waiting for another process building in {build_dir} (a one-time build; later runs reuse it)")
            fcntl.flock(fd, fcntl.LOCK_EX)
        wait_for_baton(build_dir)
        yield
    finally:
        os.close(fd)  # drops the lock


@contextlib.contextmanager
def _path_first(directory: str | None) -> Iterator[None]:
    """``PATH`` with ``directory`` first, for the block only (put back exactly as it was)."""
    old = os.environ.get("PATH")
    if directory is None or (old or "").split(os.pathsep)[0] == directory:
        yield
        return
    os.environ["PATH"] = os.pathsep.join([directory, old]) if old else directory
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = old


def tied_ninja(build_dir: Path) -> str | None:
    """A directory (in ``build_dir``, written under its lock) holding a ``ninja`` that runs :func:`ninja_dir`'s in a
    session tied to its caller (``frod_ds.runtime.tied_session``): when the launch dies mid-build, ninja and its
    compilers die with it. None where that cannot be done (no ninja, not Linux): then the plain ninja."""
    real = ninja_dir()
    if real is None or not tied_session.supported():
        return real
    bin_dir = build_dir / _BIN
    bin_dir.mkdir(exist_ok=True)
    script = tied_session.wrapper_script(str(Path(real) / "ninja"))
    wrapper = bin_dir / "ninja"
    if not wrapper.is_file() or wrapper.read_text() != script:
        atomic_write_text(wrapper, script)
        wrapper.chmod(0o755)
    return str(bin_dir)


# what a DeepSpeed op builder's compatibility check looks for, and what a run can use instead
NEEDS = {
    "async_io": (
        "libaio's library and headers (Debian/Ubuntu: apt install libaio-dev; or CFLAGS/LDFLAGS pointing at them)",
        "or offload to CPU memory with ds_configs/zero3_offload.json",
    ),
}


def check_buildable(builder: Any) -> None:
    """``FrodError`` (one line) when ``builder``'s op cannot be built on this machine (DeepSpeed's own
    ``is_compatible``), naming what is missing, before anything starts rather than mid-build."""
    if builder.is_compatible(verbose=False):
        return
    what, instead = NEEDS.get(builder.name, ("what its builder checks for", ""))
    raise FrodError(
        f"DeepSpeed's {builder.name} op cannot be built on this machine: it needs {what}; install it, {instead}".rstrip(
            ", "
        )
    )


def load_op(builder: Any) -> Any:
    """``builder.load()`` (a DeepSpeed ``OpBuilder``) under :func:`build_lock`, its ninja the pinned one run in a
    session tied to this process (:func:`tied_ninja`). DeepSpeed keeps the loaded module, so its own later
    ``load()`` of the same op builds nothing. A failed compile is a ``FrodError`` (its output printed first)."""
    build_dir = extensions_dir() / builder.name
    with build_lock(build_dir), _path_first(tied_ninja(build_dir)):
        if not (build_dir / f"{builder.name}.so").is_file():  # a compile of minutes, silent otherwise
            note(f"building DeepSpeed's {builder.name} op in {build_dir}: a one-time C++ compile of a few minutes")
        try:
            return builder.load(verbose=False)
        except RuntimeError as e:  # torch's "Error building extension '<name>': <the compiler's output>"
            if not str(e).startswith("Error building extension"):
                raise
            print(str(e), file=sys.stderr, flush=True)
            raise FrodError(
                f"building DeepSpeed's {builder.name} op in {build_dir} failed (the compiler's output is above); fix "
                f"the build environment (a C++ compiler, ninja), or use a DeepSpeed config that needs no {builder.name}"
            ) from None
