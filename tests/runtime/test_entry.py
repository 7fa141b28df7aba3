"""The entry helper every launch script runs through: a user mistake is one ``error:`` line and exit 2, a bug
keeps its traceback; the cross-rank helpers turn only user mistakes into agreed errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from frod_ds.runtime import deepspeed_state, entry
from frod_ds.runtime import distributed as D
from frod_ds.runtime.errors import FrodError, StoreError
from tests.support.helpers_ckpt import REPO


def _raise(e: BaseException):
    def body():
        raise e

    return body


def test_user_error_is_one_line_and_exit_2(capsys):
    assert entry.run(_raise(StoreError("factor store x is corrupt\nrebuild it")), init_group=False) == 2
    assert capsys.readouterr().err == "error: factor store x is corrupt rebuild it\n"
    assert entry.run(_raise(D.CollectiveError("agreed")), init_group=False) == 2
    assert capsys.readouterr().err == "error: agreed\n"
    assert entry.run(lambda: None, init_group=False) == 0 and entry.run(lambda: 143, init_group=False) == 143


def test_an_output_path_under_a_file_is_one_line_naming_the_file(tmp_path, capsys):
    """``--out some/file/x``: wherever the command first creates the directory, one line that names the file in the
    way, exit 2, not a NotADirectoryError traceback."""
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "afile" / "store"
    assert entry.run(lambda: out.mkdir(parents=True), init_group=False) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and str(tmp_path / "afile") in err, err
    assert "is a file" in err and "Traceback" not in err
    with pytest.raises(FileNotFoundError):  # other OSErrors are not guessed at: a missing input stays the command's
        entry.run(lambda: open(tmp_path / "missing"), init_group=False)


def test_a_bug_is_not_a_user_error():
    with pytest.raises(ValueError, match="a bug"):
        entry.run(_raise(ValueError("a bug")), init_group=False)
    with pytest.raises(ValueError):
        D.on_all(_raise(ValueError("a bug in a collective step")))
    with pytest.raises(D.CollectiveError, match="bad input"):
        D.on_main(_raise(FrodError("bad input")))


def test_a_bug_in_a_launch_script_shows_its_traceback_and_exits_1(tmp_path):
    """An exception that is not a ``FrodError`` (here a stand-in for a failure inside torch) is a bug: its
    traceback, exit 1, and no one-line 'user error'."""
    code = (
        "import sys; sys.argv = ['export']; from frod_ds.runtime import entry\n"
        "def body():\n    raise RuntimeError('torch broke')\n"
        "sys.exit(entry.run(body, init_group=False))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "RuntimeError: torch broke" in proc.stderr
    assert not [line for line in proc.stderr.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("fast_exit", [False, True])
def test_ctrl_c_is_one_line_and_exit_130_not_a_traceback(capsys, fast_exit, monkeypatch):
    """Ctrl-C (KeyboardInterrupt, here raised while a command is still importing) is the user's stop: one line
    saying the same command continues, exit code 130, no traceback."""
    exits = []
    monkeypatch.setattr(entry.os, "_exit", lambda code: exits.append(code))

    def main():
        raise KeyboardInterrupt

    if fast_exit:
        entry.run_script(main, fast_exit=True)
    else:
        with pytest.raises(SystemExit) as ex:
            entry.run_script(main)
        exits.append(ex.value.code)
    err = capsys.readouterr().err
    assert exits == [130] and err.splitlines() == [
        "error: interrupted (Ctrl-C); the same command again continues from what was finished"
    ]


SIGTERM_BODY = """
import sys, time
from pathlib import Path
from frod_ds.formats.lease import holding
from frod_ds.runtime import entry

out = Path(sys.argv[1])

def main():
    with holding(out, "frod export"):  # what a command holds while it writes
        tmp = out.parent / (".partial-" + out.name)
        tmp.mkdir()
        try:
            (out.parent / "ready").write_text("1")
            time.sleep(60)
        finally:
            tmp.rmdir()  # what a command's own cleanup does, as after Ctrl-C

entry.run_script(main)
"""


def test_sigterm_is_one_line_and_exit_143_with_the_commands_cleanup_done(tmp_path):
    """SIGTERM (a scheduler's stop, ``kill``) to a command that is writing: its cleanup runs and its output lease
    is given back as after Ctrl-C, one line, exit 143; killed by the bare signal, the lease was left behind."""
    import signal
    import time

    from frod_ds.formats.lease import lease_path
    from tests.support.leftovers import clean_env

    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-c", SIGTERM_BODY, str(out)],
        cwd=REPO,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    t0 = time.monotonic()
    while not (tmp_path / "ready").exists():
        assert proc.poll() is None and time.monotonic() - t0 < 60, proc.communicate()
        time.sleep(0.05)
    assert lease_path(out).exists()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and err.splitlines() == [
        "error: stopped by SIGTERM; the same command again continues from what was finished"
    ], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ready"], "no temporary and no lease left"


PIPE_BODY = """
import sys
from frod_ds.runtime import entry
def body():
    if sys.argv[1] == "other":
        raise BrokenPipeError(32, "Broken pipe")  # a pipe of the command's own, not its stdout
    for i in range(100_000):
        print(f"line {i}: a plan someone reads the first line of")
entry.run_script(lambda: entry.run(body))
"""


def test_a_reader_closing_stdout_stops_the_command_quietly_as_sigpipe_would(tmp_path):
    """``frod plan | head -1``: the reader goes away and the next print fails with EPIPE; the command stops quietly
    with 141 (128 + SIGPIPE), no traceback. The same error from any other pipe is a bug and keeps its traceback."""
    from tests.support.leftovers import clean_env

    read, write = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-c", PIPE_BODY, "stdout"], cwd=REPO, env=clean_env(), stdout=write, stderr=subprocess.PIPE
    )
    os.close(write)
    with os.fdopen(read, "rb") as reader:
        assert reader.readline().startswith(b"line 0:")  # head -1 reads its line and exits
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 141 and err == b"", err
    with (tmp_path / "out").open("w") as out:
        other = subprocess.run(
            [sys.executable, "-c", PIPE_BODY, "other"], cwd=REPO, env=clean_env(), stdout=out, stderr=subprocess.PIPE
        )
    assert other.returncode == 1 and b"Traceback" in other.stderr and b"BrokenPipeError" in other.stderr


def test_run_script_gives_back_the_sigterm_handler_it_found(monkeypatch):
    """The handler is the command's while it runs: a caller's own handler is kept, the default restored."""
    import signal

    seen = []
    monkeypatch.setattr(entry.os, "_exit", lambda code: None)
    entry.run_script(lambda: seen.append(signal.getsignal(signal.SIGTERM)) or 0, fast_exit=True)
    assert seen[0] is entry._raise_terminated and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL

    def mine(signum, frame):
        pass

    old = signal.signal(signal.SIGTERM, mine)
    try:
        entry.run_script(lambda: seen.append(signal.getsignal(signal.SIGTERM)) or 0, fast_exit=True)
        assert seen[1] is mine and signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, old)


def test_each_command_in_one_process_prints_its_own_notes(monkeypatch, capsys):
    """A note prints once per command: a caller running two commands in one process (a notebook, a sweep
    driver) sees the second command's notes too, not only the first's."""
    from frod_ds.runtime.errors import note

    monkeypatch.setattr(entry.os, "_exit", lambda code: None)

    def command():
        note("the same thing twice")
        note("the same thing twice")
        return 0

    entry.run_script(command, fast_exit=True)
    entry.run_script(command, fast_exit=True)
    assert capsys.readouterr().err.count("note: the same thing twice") == 2


def _group_body(fail: BaseException | None):
    import torch.distributed as tdist

    from frod_ds.runtime import distributed as D
    from tests.support.leftovers import launcher_vars

    seen = {}

    def body():
        D.init_deepspeed()
        seen["initialized"] = tdist.is_initialized() and D.get_world_size() == 1
        seen["env"] = launcher_vars()
        if fail is not None:
            raise fail
        return 0

    return body, seen


@pytest.mark.parametrize("fail", [None, "user", "bug"])
def test_a_one_process_group_leaves_nothing_behind(monkeypatch, fail):
    """Without a launcher, DeepSpeed's one-rank group needs no address or port (an in-process store), sets only
    ``LOCAL_RANK`` (which DeepSpeed reads), and ``entry.run`` destroys it and restores the environment on every
    exit: a return, a user error, a bug. A second run in the same process works (DeepSpeed's handle is reset)."""
    import torch.distributed as tdist

    from frod_ds.runtime import entry
    from frod_ds.runtime.errors import FrodError
    from tests.support.leftovers import launcher_vars, listening_sockets

    for name in list(launcher_vars()):
        monkeypatch.delenv(name)
    sockets = listening_sockets()
    for attempt in range(2):
        error = {"user": FrodError("bad input"), "bug": RuntimeError("broke"), None: None}[fail]
        body, seen = _group_body(error)
        if fail == "bug":
            with pytest.raises(RuntimeError, match="broke"):
                entry.run(body, init_group=False)
        else:
            assert entry.run(body, init_group=False) == (0 if fail is None else entry.USER_ERROR)
        assert seen["initialized"], attempt
        assert seen["env"] == {"LOCAL_RANK": "0"}, "only the variable DeepSpeed reads, while the group lives"
        assert not tdist.is_initialized()
        assert launcher_vars() == {}
        assert listening_sockets() <= sockets


def test_deepspeed_group_builds_no_shm_comm_op_and_restores_the_op_table(monkeypatch, tmp_path):
    """DeepSpeed's CPU backend would JIT-compile its shared-memory all-reduce op (minutes on 2 cores, only
    AutoTP inference uses it) into ``TORCH_EXTENSIONS_DIR``: ``init_deepspeed`` turns it off, so nothing is
    built or loaded, and ``destroy`` puts DeepSpeed's table of compatible ops back as it was."""
    import deepspeed
    import deepspeed.comm.comm as ds_comm

    from tests.support.leftovers import launcher_vars

    for name in list(launcher_vars()):
        monkeypatch.delenv(name)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    before = dict(deepspeed.ops.__compatible_ops__)
    seen = {}

    def body():
        D.init_deepspeed()
        seen["shm_op"] = ds_comm.cdb.shm_comm_op
        seen["table"] = deepspeed.ops.__compatible_ops__.get(deepspeed_state.SHM_COMM_OP, False)
        return 0

    assert entry.run(body, init_group=False) == 0
    assert seen == {"shm_op": None, "table": False}
    assert not (tmp_path / "ext").exists(), "no op compiled"
    assert deepspeed.ops.__compatible_ops__ == before


def test_destroy_puts_back_the_linear_deepspeeds_zero_init_replaced(monkeypatch):
    """``deepspeed.zero.Init`` with ``memory_efficient_linear`` true (DeepSpeed's default; a user's JSON may keep
    it) replaces ``torch.nn.functional.linear`` for the rest of the process; ``destroy``, which every entry point
    runs on exit, puts PyTorch's back. Nothing to do, and nothing done, when it was not replaced."""
    import torch.nn.functional as F
    from deepspeed.runtime.zero.linear import zero3_linear_wrap
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses

    from frod_ds.runtime import distributed as D
    from tests.support.leftovers import launcher_vars

    for name in list(launcher_vars()):
        monkeypatch.delenv(name)
    original = F.linear
    D.destroy()
    assert F.linear is original
    try:
        D.init_deepspeed()
        InsertPostInitMethodToModuleSubClasses._enable_mem_efficient_linear(object())  # as zero.Init does
        assert F.linear is zero3_linear_wrap and F.linear is not original
    finally:
        D.destroy()
    assert F.linear is original


@pytest.mark.parametrize("keep", [False, True])
def test_deepspeeds_nvtx_ranges_are_off_while_the_group_lives_unless_asked_for(monkeypatch, keep):
    """DeepSpeed pushes and pops an NVTX range around each of ZeRO-3's fetches, releases and hooks: ``init_deepspeed``
    turns them off (``FROD_DS_NVTX=1`` keeps them, for a profiler) and ``destroy`` puts DeepSpeed's setting back.
    Checked on what DeepSpeed does, not on the flag: a function it instruments pushes a range or not."""
    import deepspeed.utils.nvtx as ds_nvtx

    from tests.support.leftovers import launcher_vars

    for name in list(launcher_vars()):
        monkeypatch.delenv(name)
    if keep:
        monkeypatch.setenv(deepspeed_state.NVTX_ENV, "1")
    else:
        monkeypatch.delenv(deepspeed_state.NVTX_ENV, raising=False)
    pushed = []
    monkeypatch.setattr(ds_nvtx, "_range_push", lambda accelerator, msg: pushed.append(msg))
    monkeypatch.setattr(ds_nvtx, "_range_pop", lambda accelerator: None)

    def instrumented():
        return 7

    call = ds_nvtx.instrument_w_nvtx(instrumented)
    before = ds_nvtx.enable_nvtx
    assert before is True, "DeepSpeed's default"
    seen = {}

    def body():
        D.init_deepspeed()
        seen["result"] = call()
        seen["pushed"] = list(pushed)
        return 0

    assert entry.run(body, init_group=False) == 0
    assert seen["result"] == 7
    assert seen["pushed"] == (
        ["test_deepspeeds_nvtx_ranges_are_off_while_the_group_lives_unless_asked_for.<locals>.instrumented"]
        if keep
        else []
    )
    assert ds_nvtx.enable_nvtx is before
    call()
    assert len(pushed) == (2 if keep else 1), "after destroy DeepSpeed's ranges are back"


def test_destroy_leaves_nvtx_ranges_off_where_they_were_off_before(monkeypatch):
    """``destroy`` puts back the value DeepSpeed's switch had, not DeepSpeed's default: ranges a caller had turned off
    before ``init_deepspeed`` (as ``engine.compile()`` does) stay off."""
    import deepspeed.utils.nvtx as ds_nvtx

    from tests.support.leftovers import launcher_vars

    for name in list(launcher_vars()):
        monkeypatch.delenv(name)
    monkeypatch.delenv(deepspeed_state.NVTX_ENV, raising=False)
    monkeypatch.setattr(ds_nvtx, "enable_nvtx", False)
    seen = {}

    def body():
        D.init_deepspeed()
        seen["during"] = ds_nvtx.enable_nvtx
        return 0

    assert entry.run(body, init_group=False) == 0
    assert seen == {"during": False}
    assert ds_nvtx.enable_nvtx is False


def test_too_many_open_files_is_one_line_naming_the_limit(capsys):
    """``ulimit -n`` too low for what a command opens (EMFILE; ENFILE for the system's table): one line naming the
    limit in force and what to do, exit 2, not a traceback from whichever open() hit it."""
    import errno
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    for code in (errno.EMFILE, errno.ENFILE):
        fail = OSError(code, os.strerror(code), "/usr/lib/python3/encodings/ascii.py")
        assert entry.run(_raise(fail), init_group=False) == 2
        err = capsys.readouterr().err
        assert err == f"error: {os.strerror(code)} (ulimit -n is {soft}): raise the limit and re-run the same command\n"


def test_a_name_past_the_file_systems_limit_is_one_line(capsys, tmp_path):
    """ENAMETOOLONG wherever a command first touches the path (``Path.exists`` raises it): one line naming the path
    and how long its longest name is, exit 2, not a traceback. A real one from the file system, then a whole path
    too long with short names."""
    import errno

    long = tmp_path / ("x" * 300)
    assert entry.run(lambda: long.exists(), init_group=False) == 2
    err = capsys.readouterr().err
    want = f"error: {long}: a name in this path is 300 bytes long, past the file system's limit (255); "
    assert err == want + "choose a shorter path\n", err
    deep = "/".join(["d" * 200] * 30)
    fail = OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG), deep)
    assert entry.run(_raise(fail), init_group=False) == 2
    err = capsys.readouterr().err
    assert err == f"error: {deep}: the path is longer than the file system allows; choose a shorter path\n", err


def test_a_deleted_working_directory_is_one_line_before_anything_loads(tmp_path):
    """A command started from a folder that was deleted: torch's MKL failed to load and Path.cwd() raised; now one
    line says so and what to do, before any import."""
    from tests.support.leftovers import clean_env

    gone = tmp_path / "gone"
    gone.mkdir()
    body = (
        "import os, sys; d = sys.argv.pop(1); os.chdir(d); os.rmdir(d)\nfrom frod_ds.cli.main import console; console()"
    )
    run = subprocess.run(
        [sys.executable, "-c", body, str(gone), "plan", "--help"],
        cwd=REPO,
        env={**clean_env(), "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and run.stderr.splitlines() == [
        "error: the working directory no longer exists (deleted or moved away); cd to an existing folder and run the "
        "command again"
    ], run.stderr


def test_a_library_whose_compiled_part_does_not_load_is_one_line(capsys):
    """ImportError of a shared object (``ulimit -v`` too low for libtorch) is the environment's, named in one line;
    any other ImportError is a bug or a missing package and keeps its traceback."""

    def fails(message: str):
        def main() -> int:
            raise ImportError(message)

        return main

    with pytest.raises(SystemExit) as e:
        entry.run_script(fails("libtorch_cpu.so: failed to map segment from shared object"))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: a library's compiled part did not load (libtorch_cpu.so")
    assert "ulimit -v" in err and "Traceback" not in err
    with pytest.raises(ImportError, match="No module named"):
        entry.run_script(fails("No module named 'frod_ds.nothing'"))


def test_a_report_stdout_cannot_take_after_the_output_is_published_says_the_output_is_whole(capsys):
    """``frod convert-gguf … > /dev/full``: the checkpoint was published, then its report line failed with ENOSPC.
    The line blamed a disk and said to run the command again (which then asks for --overwrite); it now says the
    output is whole. Without a published output the disk-full line stands."""
    import errno as errno_module

    from frod_ds.runtime.errors import completed, forget_notes

    def report_fails() -> int:
        completed("--out /x/cv")
        raise OSError(errno_module.ENOSPC, "No space left on device")

    try:
        assert entry.run(report_fails, init_group=False) == 2
    finally:
        forget_notes()
    err = capsys.readouterr().err.strip()
    assert err == (
        "error: cannot write the command's report (No space left on device); it came after --out /x/cv was "
        "complete: that output is whole and kept, nothing needs to run again"
    ), err

    def write_fails() -> int:
        raise OSError(errno_module.ENOSPC, "No space left on device", "/x/cv/model.safetensors")

    assert entry.run(write_fails, init_group=False) == 2
    assert "No space left on device" in capsys.readouterr().err


def test_a_peer_lost_in_a_collective_is_one_line_and_exit_1(capsys, monkeypatch):
    """Several ranks: a collective whose peer process died (gloo's "Connection reset by peer") is one line naming
    it as another rank's stop, exit 1; the same RuntimeError on one rank, or another RuntimeError, stays a bug."""
    monkeypatch.setattr(D, "get_world_size", lambda: 2)
    monkeypatch.setattr(D, "get_rank", lambda: 0)
    monkeypatch.setattr(D, "destroy", lambda: None)
    lost = "[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:29500: Connection reset by peer"

    def body():
        raise RuntimeError(lost)

    assert entry.run(body, init_group=False) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: [rank 0] another rank of this job stopped")
    assert "Connection reset by peer" in err[0] and "Traceback" not in err[0]

    def bug():
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        entry.run(bug, init_group=False)
    monkeypatch.setattr(D, "get_world_size", lambda: 1)
    with pytest.raises(RuntimeError, match="Connection reset by peer"):
        entry.run(body, init_group=False)


def test_a_writer_never_writes_through_what_sits_at_its_temporary_name(tmp_path):
    """``atomic_write_text`` writes ``x`` via ``x.frod-tmp``: a killed write's leftover there (a regular file of one
    name) is its own and replaced; a link (to a user's file), a second name of one (hard link), a named pipe or a
    folder is refused naming it, and the user's file keeps its bytes. A user's ``x.tmp`` is no name of frod-ds's:
    left as it is (round 23: five of frod-ds's ``.tmp`` names deleted a user's file there)."""
    from frod_ds.runtime.atomic import atomic_write_text

    out, tmp, decoy = tmp_path / "x", tmp_path / "x.frod-tmp", tmp_path / "users_file"
    tmp.write_text("half a write")
    (tmp_path / "x.tmp").write_text("a user's file")
    atomic_write_text(out, "new")
    assert out.read_text() == "new" and not tmp.exists() and (tmp_path / "x.tmp").read_text() == "a user's file"
    decoy.write_text("keep me")
    plants = {
        "a symbolic link to": lambda: tmp.symlink_to(decoy),
        "a file with 2 names": lambda: os.link(decoy, tmp),
        "a named pipe": lambda: os.mkfifo(tmp),
        "a folder": lambda: tmp.mkdir(),
    }
    for said, plant in plants.items():
        plant()
        with pytest.raises(FrodError, match=f"{tmp} is in the way of writing x: it is {said}"):
            atomic_write_text(out, "newer")
        assert decoy.read_text() == "keep me" and out.read_text() == "new"
        tmp.rmdir() if tmp.is_dir() and not tmp.is_symlink() else tmp.unlink()


def test_a_fast_exit_with_stdout_closed_exits_with_the_commands_code(tmp_path):
    """A command started with its stdout closed (``>&-``: Python's sys.stdout is then None) ends with its own exit
    code, not an AttributeError from flushing a stream that is not there (training and eval exit fast)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from frod_ds.runtime.entry import run_script\n"
        "assert sys.stdout is None\n"
        "run_script(lambda: 3, fast_exit=True)\n"
    )
    script = tmp_path / "s.py"
    script.write_text(code)
    res = subprocess.run(
        ["bash", "-c", f'"{sys.executable}" "{script}" >&-'],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))},
        timeout=60,
    )
    assert res.returncode == 3 and "Traceback" not in res.stderr, res.stderr
