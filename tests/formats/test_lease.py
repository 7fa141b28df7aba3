"""The writer's lease (``frod_ds.formats.lease``): while a live process holds an output's lease, a second writer is
refused at once with one line naming the holder (host, pid, Slurm job); a lease whose holder is gone — a dead pid or
a pid now another process's on this host, a heartbeat gone stale on another host, the same Slurm job requeued — is
taken over with a ``note:``; of several takers exactly one wins. Holders are real second processes."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import frod_ds.formats.lease as lease_module
from frod_ds.formats.lease import STALE_S, acquire, holding, lease_path, read_lease
from frod_ds.formats.output_dir import LEASE_FORMAT, LeaseRecord
from frod_ds.formats.records import record_to_json
from frod_ds.runtime.errors import FrodError
from tests.support.leftovers import REPO, clean_env
from tests.support.odd_files import ODD_ENTRIES, plant

HOLD = """
import sys, time
from frod_ds.formats.lease import acquire
lease = acquire(sys.argv[1], "training-run", "output_dir")
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


def holder(out: Path, seconds: float = 60, **env: str) -> subprocess.Popen:
    """A second process holding ``out``'s lease (its line ``held`` read: it holds it now)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out), str(seconds)],
        cwd=REPO,
        env={**clean_env(), "PYTHONPATH": str(REPO), **env},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def planted(out: Path, age: float = 0.0, **fields) -> Path:
    """A lease file as another process would have left it, its heartbeat ``age`` seconds old."""
    record = {
        "format": LEASE_FORMAT,
        "kind": "training-run",
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.time() - age,
        "token": "0123456789abcdef",
        "command": "frod train",
    } | fields
    path = lease_path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(record_to_json(LeaseRecord(**record)))
    os.utime(path, (time.time() - age, time.time() - age))
    return path


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def no_slurm(monkeypatch):
    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SLURM_STEP_ID"):
        monkeypatch.delenv(name, raising=False)


def test_a_second_writer_is_refused_at_once_naming_the_holder(tmp_path, no_slurm):
    out = tmp_path / "run"
    proc = holder(out, SLURM_JOB_ID="4711")
    try:
        t0 = time.monotonic()
        with pytest.raises(FrodError) as e:
            acquire(out, "training-run", "output_dir")
        line = str(e.value)
        assert time.monotonic() - t0 < 5 and "\n" not in line
        assert f"output_dir {out} is being written by frod train" in line
        assert f"pid {proc.pid} on host {socket.gethostname()}" in line and "Slurm job 4711" in line
        assert json.loads(lease_path(out).read_text())["pid"] == proc.pid  # its lease untouched
    finally:
        proc.kill()
        proc.wait()


def test_the_lease_is_gone_when_its_writer_ends_and_so_are_folders_made_for_it(tmp_path, no_slurm):
    out = tmp_path / "a" / "b" / "run"
    with holding(out, "training-run", "output_dir"):
        assert lease_path(out).is_file() and not out.exists()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["Ctrl-C", "SIGTERM"])
def test_a_stop_while_the_lease_is_given_back_leaves_no_lease_and_a_true_line(
    tmp_path, no_slurm, monkeypatch, capsys, stop
):
    """A stop arriving as a finished command gives its lease back is delivered once the lease is gone (it was left
    behind), and the command's line says its output is whole (it promised that a re-run continues)."""
    from frod_ds.runtime import entry

    out = tmp_path / "d"
    release = lease_module.Lease.release

    def stopped_midway(lease):
        signal.raise_signal(stop)
        release(lease)

    def command() -> int:
        with holding(out, "data-build", "--out"):
            out.mkdir()  # published
        return 0

    monkeypatch.setattr(lease_module.Lease, "release", stopped_midway)
    # a command starts with Python's own handling of the stops (a test run before this one in the worker may not)
    defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    before = {s: signal.signal(s, h) for s, h in defaults.items()}
    try:
        with pytest.raises(SystemExit) as stopped:
            entry.run_script(command)
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    assert stopped.value.code == {signal.SIGINT: 130, signal.SIGTERM: 143}[stop]
    assert not lease_path(out).exists() and out.is_dir()
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .endswith(f"it came after --out {out} was complete: that output is whole and kept, nothing needs to run again")
    )

    monkeypatch.setattr(lease_module.Lease, "release", release)
    with holding(tmp_path / "run", "training-run", "output_dir"), holding(tmp_path / "ad", "adapter", "adapter dir"):
        pass
    from frod_ds.runtime.errors import last_completed

    assert last_completed() == f"output_dir {tmp_path / 'run'}"  # an enclosed output is not the command's


def test_a_dead_writers_lease_is_taken_over_with_a_note(tmp_path, capsys, no_slurm):
    out = tmp_path / "run"
    proc = holder(out)
    proc.send_signal(signal.SIGKILL)  # no chance to remove its lease
    proc.wait()
    assert json.loads(lease_path(out).read_text())["pid"] == proc.pid
    with holding(out, "training-run", "output_dir"):
        assert json.loads(lease_path(out).read_text())["pid"] == os.getpid()
    err = capsys.readouterr().err
    assert f"note: output_dir {out}: taking over the lease of frod train (pid {proc.pid}" in err
    assert f"pid {proc.pid} is gone" in err


def test_a_killed_writer_not_yet_reaped_is_gone(tmp_path, capsys, no_slurm):
    """SIGKILLed, its parent (here, this test) not yet waiting for it: a zombie answers kill(pid, 0) but writes
    nothing more, so its lease is taken over; it blocked every rerun while a supervising script had not reaped it."""
    out = tmp_path / "run"
    proc = holder(out)
    proc.send_signal(signal.SIGKILL)
    deadline = time.time() + 30
    while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.time() < deadline, "the holder did not die"
        time.sleep(0.05)
    os.kill(proc.pid, 0)  # the zombie is still "there" to a plain pid check
    with holding(out, "training-run", "output_dir"):
        assert json.loads(lease_path(out).read_text())["pid"] == os.getpid()
    assert f"pid {proc.pid} is gone" in capsys.readouterr().err
    proc.wait()


def test_a_reused_pid_is_not_taken_for_the_holder(tmp_path, capsys, no_slurm):
    """The recorded pid runs again, but another process (it started at another time): taken over."""
    out = tmp_path / "run"
    planted(out, pid=os.getpid(), pid_start=1)
    with holding(out, "training-run", "output_dir"):
        pass
    assert f"pid {os.getpid()} is now another process" in capsys.readouterr().err


def test_a_stale_heartbeat_from_another_host_is_taken_over_and_a_fresh_one_is_not(tmp_path, capsys, no_slurm):
    out = tmp_path / "run"
    planted(out, age=STALE_S - 60, host="gpu-elsewhere", pid=dead_pid())  # a dead pid here says nothing there
    with pytest.raises(FrodError, match="pid .* on host gpu-elsewhere"):
        acquire(out, "training-run", "output_dir")
    planted(out, age=STALE_S + 60, host="gpu-elsewhere")
    with holding(out, "training-run", "output_dir"):
        pass
    assert "its heartbeat stopped" in capsys.readouterr().err


def test_the_heartbeat_refreshes_the_leases_mtime(tmp_path, no_slurm):
    out = tmp_path / "run"
    lease = acquire(out, "training-run", "output_dir", heartbeat_s=0.05)
    try:
        old = time.time() - 1000
        os.utime(lease_path(out), (old, old))
        deadline = time.time() + 10
        while os.stat(lease_path(out)).st_mtime < old + 500:
            assert time.time() < deadline, "no heartbeat in 10 s"
            time.sleep(0.05)
    finally:
        lease.release()
    assert not lease_path(out).exists()


def test_the_same_slurm_job_requeued_takes_over_its_own_lease(tmp_path, capsys, monkeypatch):
    """A node lost: the job's rank 0 on it never ended, its heartbeat is fresh; the requeued job (same id, next
    restart count) takes over. Another job's fresh lease, or the same job's same start, is refused."""
    out = tmp_path / "run"
    monkeypatch.setenv("SLURM_JOB_ID", "812")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    planted(out, host="n1", slurm_job="813", slurm_restart=0)
    with pytest.raises(FrodError, match="Slurm job 813"):
        acquire(out, "training-run", "output_dir")
    planted(out, host="n1", slurm_job="812", slurm_restart=1)
    with pytest.raises(FrodError, match="Slurm job 812"):
        acquire(out, "training-run", "output_dir")
    planted(out, host="n1", slurm_job="812", slurm_restart=0)
    with holding(out, "training-run", "output_dir"):
        held = json.loads(lease_path(out).read_text())
        assert (held["slurm_job"], held["slurm_restart"]) == ("812", 1)
    assert "Slurm job 812 was requeued (restart 0 → 1)" in capsys.readouterr().err


def test_of_several_takers_of_a_stale_lease_exactly_one_wins(tmp_path, no_slurm):
    out = tmp_path / "run"
    planted(out, pid=dead_pid())
    go = tmp_path / "go"
    code = (
        "import sys, time, pathlib\n"
        "from frod_ds.formats.lease import acquire\n"
        "from frod_ds.runtime.errors import FrodError\n"
        "while not pathlib.Path(sys.argv[2]).exists(): time.sleep(0.001)\n"
        "try:\n"
        "    acquire(sys.argv[1], 'training-run', 'output_dir'); print('won', flush=True); time.sleep(5)\n"
        "except FrodError as e:\n"
        "    print('refused', e, flush=True)\n"
    )
    env = {**clean_env(), "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(out), str(go)], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    time.sleep(1.0)  # all four started and waiting
    go.touch()
    lines = [p.stdout.readline().strip() for p in procs]
    for p in procs:
        p.kill()
        p.wait()
    assert sum(line == "won" for line in lines) == 1, lines
    assert all(line == "won" or "is being written by frod train" in line for line in lines), lines


def test_a_child_handed_the_lease_writes_under_it(tmp_path, no_slurm):
    """``frod demo`` holds its folder's lease and runs training into it: the child is let in, a stranger is not."""
    out = tmp_path / "demo"
    code = (
        "import sys\nfrom frod_ds.formats.lease import holding\n"
        "with holding(sys.argv[1], 'training-run'):\n    print(1)"
    )
    with holding(out, "demo") as lease:
        env = {**clean_env(), "PYTHONPATH": str(REPO)}
        child = subprocess.run([sys.executable, "-c", code, str(out)], env=lease.child_env(env), capture_output=True)
        stranger = subprocess.run([sys.executable, "-c", code, str(out)], env=env, capture_output=True, text=True)
        assert child.stdout.decode().strip() == "1", child.stderr
        assert stranger.returncode != 0 and "is being written by frod demo" in stranger.stderr
        assert read_lease(lease_path(out))[0].token == lease.record.token  # the child left it in place


def test_a_lease_that_is_not_ours_is_named_and_left_alone(tmp_path, no_slurm):
    out = tmp_path / "run"
    lease_path(out).write_text("locked by hand\n")
    with pytest.raises(FrodError, match="not a frod-ds lease"):
        acquire(out, "training-run", "output_dir")
    assert lease_path(out).read_text() == "locked by hand\n"


def test_an_output_inside_a_folder_another_writer_holds_is_refused(tmp_path, no_slurm):
    """A second run into ``run/sub`` while ``run`` is being written: refused naming the holder (the two would share
    ``run``); once that writer is gone a folder inside a finished output is fine (``runs/x/eval``), and a child the
    holder handed its lease may write inside it."""
    out = tmp_path / "run"
    proc = holder(out)
    try:
        with pytest.raises(FrodError) as e:
            acquire(out / "sub", "eval-results", "--output")
        line = str(e.value)
        assert f"--output {out / 'sub'} is inside {out}, which frod train" in line and f"pid {proc.pid}" in line
        assert not (out / "sub").exists() and not lease_path(out / "sub").exists()
    finally:
        proc.kill()
        proc.wait()
    with holding(out / "sub", "eval-results", "--output"):
        pass
    code = (
        "import sys\nfrom frod_ds.formats.lease import holding\n"
        "with holding(sys.argv[1], 'eval-results'):\n    print(1)"
    )
    with holding(out, "demo") as lease:
        env = {**clean_env(), "PYTHONPATH": str(REPO)}
        child = subprocess.run(
            [sys.executable, "-c", code, str(out / "sub")], env=lease.child_env(env), capture_output=True
        )
        assert child.stdout.decode().strip() == "1", child.stderr


@pytest.mark.parametrize("kind", ["file", "link to a file", "fifo", "broken link"])
def test_an_output_that_is_not_a_folder_is_refused_with_no_lease_beside_it(tmp_path, no_slurm, kind, monkeypatch):
    """A user's file given as the output is refused before anything is placed beside it: the folder holding it
    must look the same during and after the refusal (no transient lease file among the user's own)."""
    target = tmp_path / "data" / "train.jsonl"
    target.parent.mkdir()
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "broken link":
        target.symlink_to(tmp_path / "data" / "gone")
    else:
        (tmp_path / "data" / "real.jsonl").write_text("{}\n")
        if kind == "file":
            target.write_text("{}\n")
        else:
            target.symlink_to(tmp_path / "data" / "real.jsonl")
    before = sorted(p.name for p in target.parent.iterdir())
    placed = []
    real_place = lease_module._place
    monkeypatch.setattr(lease_module, "_place", lambda path, record: placed.append(path) or real_place(path, record))
    it = {"fifo": r"a named pipe \(FIFO\)", "broken link": "a link to nothing"}.get(kind, "a file")
    with pytest.raises(FrodError, match=f"train.jsonl is {it}, not a folder; give --out a directory path"):
        acquire(target, "data-build", "--out")
    assert placed == [] and sorted(p.name for p in target.parent.iterdir()) == before


@pytest.mark.parametrize("value", ["{oops", "[]", '{"/x/.frod-ds-lease": 7}', "null"])
def test_a_leases_variable_that_is_not_frods_own_is_one_line_naming_it(tmp_path, monkeypatch, value):
    """FROD_DS_LEASES (what frod demo hands its stages) left from another shell or typed: one line naming the
    variable and how to clear it, nothing made; a handed lease in the right form is still honoured."""
    monkeypatch.setenv(lease_module.ENV, value)
    with pytest.raises(FrodError, match=r"variable FROD_DS_LEASES is .*; unset it \(unset FROD_DS_LEASES\)"):
        acquire(tmp_path / "out", "frod data build")
    assert not (tmp_path / "out").exists()
    monkeypatch.setenv(lease_module.ENV, json.dumps({str(tmp_path / "elsewhere"): "t"}))
    acquire(tmp_path / "out", "frod data build").release()


def test_a_stale_lease_behind_a_fresh_takeover_mutex_names_the_mutex_and_when_to_retry(tmp_path, no_slurm, capsys):
    """A dead writer's lease and a fresh takeover mutex (a taker mid-way, or one that died there): the refusal names
    the mutex, its age and when a retry can pass, and no "taking over" note is printed for a takeover not done; once
    the mutex is older than a takeover can be, the same call takes the lease over."""
    out = tmp_path / "out"
    path = planted(out, pid=dead_pid())
    mutex = path.with_name(path.name + ".takeover")
    mutex.write_text("")
    with pytest.raises(FrodError, match=r"being taken over .*\.takeover is \d+ s old\); try again in \d+ s, or remove"):
        acquire(out, "frod train")
    assert "taking over" not in capsys.readouterr().err and path.is_file()
    old = time.time() - lease_module.TAKEOVER_S - 5
    os.utime(mutex, (old, old))
    acquire(out, "frod train").release()
    assert not mutex.exists() and "taking over the lease" in capsys.readouterr().err


@pytest.mark.parametrize("entry", ODD_ENTRIES)
def test_an_entry_no_lease_can_be_is_named_and_never_read_or_removed(tmp_path, no_slurm, entry):
    """A link, a named pipe, a device or a folder where the lease goes, or a file of bytes that are no text: named in
    one line at once (a pipe blocked the read, /dev/zero filled the memory, bad bytes gave a traceback, a dangling
    link was taken for a lease released meanwhile) and left where it is."""
    out = tmp_path / "out"
    path = lease_path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    plant(path, entry)
    if entry == "not UTF-8":
        old = time.time() - 10
        os.utime(path, (old, old))
    t0 = time.monotonic()
    with pytest.raises(FrodError, match=f"is locked by {path}, which is .*not a frod-ds lease; remove it"):
        acquire(out, "frod data build")
    assert time.monotonic() - t0 < 5 and os.path.lexists(path)


def test_a_lease_naming_a_pid_past_any_process_is_gone(tmp_path, capsys, no_slurm):
    """A garbled lease of this host naming pid 2**40 (past what kill() takes): its holder is gone, taken over with
    the note, not an OverflowError."""
    out = tmp_path / "run"
    planted(out, pid=2**40)
    with holding(out, "training-run", "output_dir"):
        assert json.loads(lease_path(out).read_text())["pid"] == os.getpid()
    assert f"pid {2**40} is gone" in capsys.readouterr().err


@pytest.mark.parametrize("count", ["abc", "\u00b2", "\u0663", "1" * 5000])
def test_a_restart_count_slurm_never_sets_is_one_line(tmp_path, monkeypatch, count):
    """SLURM_RESTART_COUNT that is not a few ASCII digits (a superscript or an Arabic-Indic digit, which ``int``
    cannot read or Slurm never writes; thousands of digits), inside a job: named in one line, cut short where long,
    before any lease is placed."""
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    monkeypatch.setenv("SLURM_RESTART_COUNT", count)
    said = repr(count) if len(count) < 40 else f"{count[:20]!r}... (5000 characters)"
    with pytest.raises(FrodError, match=re.escape(f"SLURM_RESTART_COUNT={said} is no restart count")):
        with holding(tmp_path / "run", "training-run", "output_dir"):
            pass
    assert not lease_path(tmp_path / "run").exists()


def test_a_lease_started_at_an_impossible_time_is_described_not_raised(tmp_path, no_slurm):
    """A live holder's lease whose ``started`` no clock gives (1e308): the refusal names it, no OverflowError."""
    out = tmp_path / "run"
    planted(out, started=1e308)
    with pytest.raises(FrodError, match=r"since an impossible time \(1e\+308\)"):
        with holding(out, "training-run", "output_dir"):
            pass


def test_a_token_read_from_the_lease_file_lets_no_unrelated_writer_in(tmp_path, no_slurm):
    """A live holder's token copied from its lease file into FROD_DS_LEASES by a command it did not start: refused
    as a second writer, and the holder's lease stays; its own child (``child_env``) is let in, as above."""
    from frod_ds.formats.lease import ENV

    out = tmp_path / "run"
    proc = holder(out)
    try:
        token = json.loads(lease_path(out).read_text())["token"]
        code = (
            "import sys\nfrom frod_ds.formats.lease import holding\n"
            "with holding(sys.argv[1], 'training-run'):\n    print(1)"
        )
        env = {**clean_env(), "PYTHONPATH": str(REPO), ENV: json.dumps({str(lease_path(out)): token})}
        forged = subprocess.run([sys.executable, "-c", code, str(out)], env=env, capture_output=True, text=True)
        assert forged.returncode != 0 and "is being written by" in forged.stderr, forged.stderr
        assert json.loads(lease_path(out).read_text())["token"] == token
    finally:
        proc.terminate()
        proc.wait()


def test_a_live_holder_on_this_host_is_not_taken_over_by_another_restart_count(tmp_path, monkeypatch):
    """Slurm ends a job's processes before it requeues it: a live process on this host holding the lease under the
    same job and another restart count is a second writer (two job steps, a hand-set SLURM_RESTART_COUNT), never a
    requeued attempt's leftover; refused, naming it. Once that process is gone, the lease is taken over."""
    out = tmp_path / "run"
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        planted(out, pid=holder.pid, pid_start=None, slurm_job="77", slurm_restart=0)
        with pytest.raises(FrodError, match=f"pid {holder.pid} on host"):
            acquire(out, "training-run", "output_dir")
    finally:
        holder.kill()
        holder.wait()
    with holding(out, "training-run", "output_dir"):
        assert json.loads(lease_path(out).read_text())["slurm_restart"] == 1


@pytest.mark.parametrize(
    "code,advice",
    [(28, "; free space on that disk and re-run"), (30, "; the disk is read-only: remount it writable and re-run")],
    ids=["full", "read-only"],
)
def test_a_lease_a_full_disk_refuses_says_so_and_to_run_again(tmp_path, monkeypatch, code, advice):
    """The lease is the first file a writer places, so a full (or read-only) disk refuses it first: the line says
    what to do about the disk and to run the same command again (choosing another folder would start a finished
    run over), and nothing is left behind."""
    import errno

    assert code == {28: errno.ENOSPC, 30: errno.EROFS}[code]

    def refused(*args, **kwargs):
        raise OSError(code, os.strerror(code), str(args[0]))

    monkeypatch.setattr(lease_module, "_place", refused)
    out = tmp_path / "run"
    with pytest.raises(FrodError) as e:
        acquire(out, "training-run", "output_dir")
    line = str(e.value)
    assert line.startswith(f"output_dir {out}: cannot write its lease (") and advice in line, line
    assert "another" not in line and sorted(os.listdir(tmp_path)) == []


def test_a_stop_while_the_lease_is_placed_leaves_no_lease(tmp_path, monkeypatch):
    """SIGTERM arriving inside ``acquire``, the lease file already placed (as a launcher's stop right at start-up
    can): it is delivered once ``holding`` can take the lease away, so none is left behind."""
    real = lease_module.acquire

    def acquire_then_stopped(*args, **kwargs):
        lease = real(*args, **kwargs)
        signal.raise_signal(signal.SIGTERM)  # held back until the lease is in hand
        return lease

    def stop(signum, frame):
        raise KeyboardInterrupt

    monkeypatch.setattr(lease_module, "acquire", acquire_then_stopped)
    before = signal.signal(signal.SIGTERM, stop)
    out = tmp_path / "data"
    try:
        with pytest.raises(KeyboardInterrupt), holding(out, "data-build"):
            pytest.fail("the block must not run after the stop")
    finally:
        signal.signal(signal.SIGTERM, before)
    assert not lease_path(out).exists() and sorted(os.listdir(tmp_path)) == []
