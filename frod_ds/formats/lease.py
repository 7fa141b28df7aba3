"""The writer's lease on its output folder: one writer at a time, for the writer's whole life (docs/formats.md).

A writer takes ``.<name>.frod-ds-lease`` beside folder ``<name>`` (shortened where too long, ``sibling_names``)
before it touches it (made complete, then hard-linked into place: one of two writers gets it), refreshes its mtime
every ``HEARTBEAT_S`` and removes it at the end. A second writer is refused at once, naming the holder; a lease
whose holder is gone (a dead or reused pid on this host, a heartbeat older than ``STALE_S`` from another host, the
same Slurm job requeued) is taken over with a ``note:``. Under several ranks the writing rank holds it
(``distributed.held_on_main``); a child writes under its parent's lease when handed its token (``Lease.child_env``).
Torch-free.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import socket
import stat
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from frod_ds.formats.output_dir import LEASE, LEASE_FORMAT, WRITERS, LeaseRecord
from frod_ds.formats.processes import boot_id, pid_alive, pid_start, proc_stat
from frod_ds.formats.records import record_from_dict, record_to_json
from frod_ds.formats.sibling_names import fitted_name, literal_home
from frod_ds.runtime import signals
from frod_ds.runtime.atomic import DISK_FULL_ERRNOS, disk_advice, file_in_the_way
from frod_ds.runtime.errors import FrodError, completed, note
from frod_ds.runtime.launch_env import launcher_int, shown
from frod_ds.runtime.paths import entry_kind
from frod_ds.runtime.strict_json import loads

__all__ = [
    "HEARTBEAT_S",
    "STALE_S",
    "ENV",
    "Lease",
    "lease_path",
    "acquire",
    "holding",
    "read_lease",
    "live_holder",
]

_depth = 0  # leases this process holds through `holding`: an enclosed one is not the command's output
HEARTBEAT_S = 30.0  # seconds between heartbeats
MAX_LEASE_BYTES = 64 * 1024  # a lease record is a few hundred bytes: more is no lease, and is not read
STALE_S = 300.0  # a heartbeat this old from another host: its writer is gone (10 missed beats)
TAKEOVER_S = 30.0  # a takeover mutex this old: its taker died mid-way (a takeover takes milliseconds)
ENV = "FROD_DS_LEASES"  # JSON {lease path: token}: leases a parent hands its children (frod demo's stages)
_MUTEX = ".takeover"  # the takeover mutex of lease NAME is NAME.takeover


def lease_path(out: Path | str) -> Path:
    """Where the lease of folder ``out`` is: ``.<name>.frod-ds-lease`` beside it (its real path, so that two
    spellings of one folder share one lease; a name too long for that and its mutex shortened, ``fitted_name``)."""
    real = Path(os.path.realpath(out))
    return real.parent / fitted_name(f".{real.name}", LEASE, room=len(_MUTEX))


def _descends_from(held: LeaseRecord) -> bool:
    """Whether this process runs under the lease's holder (a child it handed the token, or one of theirs): on the
    holder's host, its pid among this process's ancestors; elsewhere (a rank on another node) nothing to ask. A token
    read from the lease file by an unrelated command lets no second writer in."""
    if held.host != socket.gethostname() or not Path("/proc/self/stat").exists():
        return True
    pid = os.getpid()
    for _ in range(4096):  # a parent chain is never this long: stops on a loop in a damaged /proc
        if pid == held.pid:
            return True
        fields = proc_stat(pid)
        parent = launcher_int(fields[1]) if len(fields) >= 2 else None
        if parent is None or parent in (0, pid):
            return False
        pid = parent
    return False


def _handed_down(held: LeaseRecord | None, token: str | None) -> bool:
    """Whether lease ``held`` was handed to this process: its token in ``FROD_DS_LEASES``, and this process under
    its holder (``_descends_from``)."""
    return held is not None and token is not None and held.token == token and _descends_from(held)


def _slurm_restart(env: os._Environ[str] | dict[str, str]) -> int | None:
    """Slurm's restart count of this job (0 before a requeue); ``FrodError`` for a value Slurm never sets."""
    if not env.get("SLURM_JOB_ID"):
        return None
    count = (env.get("SLURM_RESTART_COUNT") or "0").strip()
    value = launcher_int(count)
    if value is None:
        raise FrodError(
            f"SLURM_RESTART_COUNT={shown(count)} is no restart count (Slurm sets a few digits), and the output's lease "
            "records it: unset it, or SLURM_JOB_ID with it outside a Slurm job"
        )
    return value


def _me(kind: str) -> LeaseRecord:
    env = os.environ
    return LeaseRecord(
        format=LEASE_FORMAT,
        kind=kind,
        host=socket.gethostname(),
        pid=os.getpid(),
        started=round(time.time(), 3),
        token=secrets.token_hex(8),
        command=WRITERS.get(kind),
        boot_id=boot_id(),
        pid_start=pid_start(os.getpid()),
        slurm_job=env.get("SLURM_JOB_ID") or None,
        slurm_restart=_slurm_restart(env),
        slurm_step=env.get("SLURM_STEP_ID") or None,
    )


def read_lease(path: Path) -> tuple[LeaseRecord | None, os.stat_result] | None:
    """The lease at ``path`` and its stat (``lstat``; mtime: the heartbeat); None when there is none; the record is
    None when the entry cannot be read as one. Only a regular file is read, and only its first bytes: a named pipe,
    a device or a link there (no lease is any of them) would block the read or never end it."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None, st
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError:
        return None, st
    try:
        data = os.read(fd, MAX_LEASE_BYTES + 1) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    except OSError:
        data = b""
    finally:
        os.close(fd)
    try:
        return record_from_dict(LeaseRecord, loads(data[:MAX_LEASE_BYTES].decode("utf-8")), str(path), FrodError), st
    except ValueError:  # not UTF-8, not JSON, not a lease record
        return None, st


def _odd(st: os.stat_result) -> str | None:
    """What an entry at a lease's name that no lease can be is (a link, a folder, a pipe…), or None for a file."""
    mode = st.st_mode
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    return entry_kind(mode)


def describe(held: LeaseRecord, st: os.stat_result, now: float | None = None) -> str:
    """The holder in a few words: what, which process where, since when, its last heartbeat."""
    now = time.time() if now is None else now
    job = f", Slurm job {held.slurm_job}" if held.slurm_job else ""
    if held.slurm_job and held.slurm_restart:
        job += f" (restart {held.slurm_restart})"
    what = f"{held.command} " if held.command else ""
    try:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(held.started))
    except (OverflowError, OSError, ValueError):  # a garbled record: no clock gives that time
        since = f"an impossible time ({held.started!r})"
    beat = now - st.st_mtime
    said = f"{max(0.0, beat):.0f} s ago"
    if beat < -60:
        said = f"stamped {-beat:.0f} s in the future (a clock ahead of this host's)"
    return f"{what}(pid {held.pid} on host {held.host}{job}, since {since}, heartbeat {said})"


def gone(held: LeaseRecord, st: os.stat_result, me: LeaseRecord, now: float | None = None) -> str | None:
    """Why the holder of ``held`` is gone, or None while it may still be writing."""
    now = time.time() if now is None else now
    if held.host == me.host:  # a live holder here is never taken over: a requeue ends the job's processes first
        if held.boot_id and me.boot_id and held.boot_id != me.boot_id:
            return "its host has rebooted since"
        if held.pid == me.pid and held.pid_start == me.pid_start:
            return None  # this very process (a second lease of the same folder): never taken from itself
        if not pid_alive(held.pid):
            return f"pid {held.pid} is gone"
        start = pid_start(held.pid)
        if held.pid_start is not None and start is not None and start != held.pid_start:
            return f"pid {held.pid} is now another process"
        return None
    if held.slurm_job and held.slurm_job == me.slurm_job and held.slurm_restart != me.slurm_restart:
        return f"Slurm job {held.slurm_job} was requeued (restart {held.slurm_restart or 0} → {me.slurm_restart or 0})"
    if now - st.st_mtime > STALE_S:
        return f"its heartbeat stopped {now - st.st_mtime:.0f} s ago, on another host"
    return None


def live_holder(path: Path) -> str | None:
    """The holder of the lease at ``path`` while it may still be writing (described), else None."""
    found = read_lease(path)
    if found is None:
        return None
    held, st = found
    if held is None:
        return None if time.time() - st.st_mtime > STALE_S else f"a process (unreadable lease {path})"
    return None if gone(held, st, _me(held.kind)) else describe(held, st)


class Lease:
    """A lease this process holds (or, ``delegated``, writes under for its parent): ``release`` ends it."""

    def __init__(self, path: Path, record: LeaseRecord, fd: int | None, created: list[Path], heartbeat_s: float):
        self.path, self.record, self._fd, self._created = path, record, fd, created
        self.delegated = fd is None
        self._stop = threading.Event()
        self._thread = None
        if not self.delegated:
            self._ino = os.fstat(fd).st_ino
            self._thread = threading.Thread(
                target=self._beat, args=(heartbeat_s,), name="frod-ds-lease-heartbeat", daemon=True
            )
            self._thread.start()

    def _beat(self, every: float) -> None:
        while not self._stop.wait(every):
            with contextlib.suppress(OSError):
                os.utime(self._fd)  # the inode: a lease taken over (renamed away) is not refreshed for its taker

    def child_env(self, env: dict[str, str] | None = None) -> dict[str, str]:
        """``env`` (default: this process's) with this lease handed on: a child started with it writes here."""
        env = dict(os.environ if env is None else env)
        leases = handed_leases(env, FrodError)
        leases[str(self.path)] = self.record.token
        env[ENV] = json.dumps(leases)
        return env

    def release(self) -> None:
        """Stop the heartbeat and remove the lease if it is still this one; directories made for it go if empty."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        if self._fd is not None:
            try:
                if os.stat(self.path).st_ino == self._ino:
                    os.unlink(self.path)
            except OSError:
                pass
            os.close(self._fd)
            self._fd = None
        for d in reversed(self._created):
            with contextlib.suppress(OSError):
                d.rmdir()
        self._created = []


def _make_parents(folder: Path, created: list[Path]) -> None:
    """Create ``folder`` and its missing parents, appending each one made to ``created`` (outermost first)."""
    missing = []
    for p in (folder, *folder.parents):
        if os.path.isdir(p):
            break
        missing.append(p)
    for p in reversed(missing):
        p.mkdir()
        created.append(p)


def _place(path: Path, record: LeaseRecord) -> int:
    """Create the lease file at ``path`` complete (write a temporary, hard-link it): its fd, or FileExistsError."""
    tmp = path.with_name(fitted_name(path.name, f".{record.host}.{record.pid}.{record.token}"))
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, record_to_json(record).encode())
        os.fsync(fd)
        try:
            os.link(tmp, path)
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise
            # a filesystem without hard links: O_EXCL on the lease itself (a reader may see it empty a moment)
            os.close(fd)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            os.write(fd, record_to_json(record).encode())
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        raise
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return fd


def _mutex(path: Path) -> Path:
    return path.with_name(path.name + _MUTEX)


def _take_from(path: Path, stale: LeaseRecord | None, st: os.stat_result) -> float | None:
    """Remove the stale lease at ``path`` (``stale``, ``st``: as it was read) under the takeover mutex
    ``path.takeover``, only if it is still that one: of two takers, the second finds the first's new lease. The
    mutex's age in seconds when another taker holds it (nothing done), else None."""
    mutex = _mutex(path)
    try:
        os.close(os.open(mutex, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        age = 0.0
        with contextlib.suppress(OSError):
            age = time.time() - os.stat(mutex).st_mtime
            if age > TAKEOVER_S:
                os.unlink(mutex)  # its taker died mid-way
        time.sleep(0.05)
        return age
    try:
        found = read_lease(path)
        if found is None:
            return
        now, now_st = found
        same = now.token == stale.token if now is not None and stale is not None else now_st.st_ino == st.st_ino
        if same:
            os.unlink(path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(mutex)


def handed_leases(env: Mapping[str, str], error: type[FrodError]) -> dict[str, str]:
    """The leases ``env``'s ``FROD_DS_LEASES`` hands on (``{lease path: token}``, what ``child_env`` writes); ``error``
    (one line) when the variable holds anything else: left from another shell, or typed."""
    raw = env.get(ENV) or "{}"
    try:
        leases = json.loads(raw)
    except ValueError:
        leases = None
    if not isinstance(leases, dict) or not all(isinstance(v, str) for v in leases.values()):
        raise error(
            f"the environment variable {ENV} is {raw[:60]!r}, not the leases frod hands its own stages (JSON "
            f"{{path: token}}); unset it (unset {ENV}) and run the command again"
        )
    return leases


def acquire(
    out: Path | str,
    kind: str,
    what: str = "--out",
    error: type[FrodError] = FrodError,
    heartbeat_s: float = HEARTBEAT_S,
) -> Lease:
    """Take the lease on folder ``out`` for a writer of ``kind``; ``error`` (one line naming the holder) while
    another writer holds it. The caller releases it (``holding`` does)."""
    out = Path(out)
    home = literal_home(out, what)
    if home:  # the lease is the first thing any writer places: nothing is made yet
        raise error(home)
    path = lease_path(out)
    me = _me(kind)
    handed = handed_leases(os.environ, error)  # leases this process's launcher holds: {path: token}
    inherited = handed.get(str(path))
    if (out.exists() or out.is_symlink()) and not out.is_dir():  # no lease is ever placed beside a user's file
        it = "a link to nothing" if not out.exists() else "a file" if out.is_file() else entry_kind(out.stat().st_mode)
        raise error(f"{what} {out} is {it}, not a folder; give {what} a directory path")
    _check_no_writer_above(out, what, error, handed)
    created: list[Path] = []
    busy: float | None = None
    try:
        _make_parents(path.parent, created)
        for _ in range(100):
            try:
                return Lease(path, me, _place(path, me), created, heartbeat_s)
            except FileExistsError:
                pass
            found = read_lease(path)
            if found is None:
                continue  # released meanwhile
            held, st = found
            if _handed_down(held, inherited):
                return Lease(path, held, None, created, heartbeat_s)
            if held is None:
                if _odd(st):  # never a lease, never removed: a user's, or another program's
                    raise error(
                        f"{what} {out} is locked by {path}, which is {_odd(st)}, not a frod-ds lease; remove it if no "
                        f"frod-ds command writes {out}, or choose another {what}"
                    )
                if time.time() - st.st_mtime <= STALE_S:
                    raise error(
                        f"{what} {out} is locked by {path}, which is not a frod-ds lease; remove it if no frod-ds "
                        f"command writes {out}, or choose another {what}"
                    )
                why, who = "an unreadable lease, untouched for a while", str(path)
            else:
                why, who = gone(held, st, me), describe(held, st)
                if why is None:
                    raise error(
                        f"{what} {out} is being written by {who}; two writers never share an output: wait for it to "
                        f"end or choose another {what} (a holder whose host is down loses the lease once its "
                        f"heartbeat is {STALE_S:.0f} s old)"
                    )
            busy = _take_from(path, held, st)
            if busy is None:
                note(f"{what} {out}: taking over the lease of {who}: {why}")
        if busy is not None:  # the stale lease stayed: another taker's mutex, fresh all along
            raise error(
                f"{what} {out}: its stale lease is being taken over by another command, or a takeover was cut off "
                f"({_mutex(path)} is {busy:.0f} s old); try again in {max(1.0, TAKEOVER_S - busy):.0f} s, or remove "
                f"that file if no frod-ds command is starting on {out}"
            )
        raise error(f"{what} {out}: other writers keep taking its lease ({path}); try again")
    except BaseException as e:
        for d in reversed(created):
            with contextlib.suppress(OSError):
                d.rmdir()
        if isinstance(e, OSError):  # a read-only or full disk: the lease is the first thing a writer writes
            blocker = file_in_the_way(path.parent)
            why = f"{blocker} is a file, not a directory" if blocker else f"{e.filename or path}: {e.strerror or e}"
            if blocker is None and e.errno in DISK_FULL_ERRNOS:  # space, a limit or a remount: the same command again
                advice = disk_advice(e, elsewhere=False)  # elsewhere, a run would start over
                raise error(f"{what} {out}: cannot write its lease ({why}); {advice} and re-run") from None
            raise error(f"{what} {out} is not writable ({why}); choose another {what}") from None
        raise


def _check_no_writer_above(out: Path, what: str, error: type[FrodError], handed: dict[str, str]) -> None:
    """``error`` when a folder above ``out`` is being written by another command (its lease live): the two would
    share that folder. A finished output may hold another (``runs/x/eval`` beside ``runs/x/adapter-final``)."""
    for above in Path(os.path.realpath(out)).parents:
        path = lease_path(above)
        if not path.is_file() and not path.is_symlink():
            continue
        found = read_lease(path)
        if found is not None and _handed_down(found[0], handed.get(str(path))):
            continue  # this command's own launcher holds it
        who = live_holder(path)
        if who is not None:
            raise error(
                f"{what} {out} is inside {above}, which {who} is writing now; two writers never share an output: "
                f"give {what} a path outside it, or wait for that command to end"
            )


@contextlib.contextmanager
def holding(out: Path | str, kind: str, what: str = "--out", error: type[FrodError] = FrodError) -> Iterator[Lease]:
    """Hold the lease on ``out`` for the block (:func:`acquire`, released however the block ends, a stop held
    back meanwhile so that the lease is never left behind). A block that ends normally has published ``out``;
    when no other lease of this process encloses it, it is the command's output, recorded as complete."""
    global _depth
    lease, done = None, False
    try:
        with signals.held():  # a stop while the lease is placed comes once the finally below can take it away
            lease = acquire(out, kind, what, error)
            _depth += 1
        yield lease
        done = True
    finally:
        if lease is not None:
            _depth -= 1
            with signals.held():
                if done and _depth == 0:
                    completed(f"{what} {out}")
                lease.release()
