"""A JIT op build killed with its launch (``kill -9``) leaves no compiler running (``frod_ds.runtime.op_build``,
``frod_ds.runtime.tied_session``), checked with a stub build: real ninja running sleeping "compilers", each in a
process group of its own as ninja starts them (``tests/support/stub_op.py``); no C++ is compiled."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.support import pace
from tests.support.leftovers import REPO, clean_env

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not (Path(sys.executable).parent / "ninja").is_file(),
    reason="process sessions and /proc (Linux), and the ninja beside this Python",
)

GUARDED = "from frod_ds.runtime import op_build; from tests.support.stub_op import StubBuilder; " + (
    "print(op_build.load_op(StubBuilder()), flush=True)"
)
BARE = "from tests.support.stub_op import StubBuilder; StubBuilder().load()"  # torch's build, no guard


def _processes(mark: str) -> list[int]:
    """Live (not zombie) processes whose command line holds ``mark``: the stub's compilers and their shells."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if state != "Z" and mark.encode() in cmdline:
            found.append(int(name))
    return found


def _start(code: str, tmp_path: Path, **env: str) -> tuple[subprocess.Popen, str]:
    mark = f"frod-stub-compiler-{uuid.uuid4().hex}"
    venv_bin = str(Path(sys.executable).parent)  # the ninja torch would run: first on PATH
    env = clean_env(
        TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"),
        FROD_STUB_PIDS=str(tmp_path / "pids"),
        FROD_STUB_MARK=mark,
        PATH=os.pathsep.join([venv_bin, os.environ.get("PATH", "")]),
        **env,
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    return proc, mark


def _compilers(tmp_path: Path, proc: subprocess.Popen, timeout: float = 30) -> list[int]:
    """The two stub compilers' pids, once both run."""
    pids = tmp_path / "pids"
    deadline = time.monotonic() + pace.scaled(timeout)
    while not (pids.is_file() and len(pids.read_text().splitlines()) == 2):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the stub build never started its compilers"
        time.sleep(0.05)
    return [int(x) for x in pids.read_text().split()]


def _left_after(mark: str, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while _processes(mark) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _processes(mark)


def _kill_all(mark: str) -> None:
    for pid in _processes(mark):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_kill_9_of_a_bare_build_leaves_its_compilers_running(tmp_path):
    """The hazard the guard is for: ninja and its compilers outlive a launch killed mid-build."""
    proc, mark = _start(BARE, tmp_path, FROD_STUB_SECONDS="60")
    compilers = _compilers(tmp_path, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    try:
        assert set(compilers) <= set(_left_after(mark, 1.0)), "the orphaned compilers kept running"
    finally:
        _kill_all(mark)


def test_kill_9_of_a_launch_mid_build_kills_its_compilers(tmp_path):
    proc, mark = _start(GUARDED, tmp_path, FROD_STUB_SECONDS="60")
    compilers = _compilers(tmp_path, proc)
    assert set(compilers) <= set(_processes(mark))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    left = _left_after(mark, 10.0)
    _kill_all(mark)  # never leave them to the next test
    assert left == [], "compilers outlived the killed launch"


def test_a_guarded_build_runs_and_loads_the_op_in_the_launch(tmp_path):
    proc, mark = _start(GUARDED, tmp_path)
    out, err = proc.communicate(timeout=pace.scaled(60))
    assert proc.returncode == 0, err
    assert out.strip() == f"stub op loaded in {proc.pid}"
    assert len((tmp_path / "pids").read_text().split()) == 2 and (tmp_path / "ext" / "stub_op" / "a.o").is_file()
    assert _processes(mark) == []


def test_a_build_says_it_runs_and_a_launch_waiting_for_anothers_build_says_so(tmp_path):
    """A first build (minutes of C++ for cpu_adam) is announced in one note, a launch waiting on another's build
    lock says what it waits for, and a launch finding the op built says nothing."""
    first, mark = _start(GUARDED, tmp_path, FROD_STUB_SECONDS="3")
    _compilers(tmp_path, first)
    second, _ = _start(GUARDED, tmp_path)
    try:
        out1, err1 = first.communicate(timeout=pace.scaled(60))
        out2, err2 = second.communicate(timeout=pace.scaled(60))
    finally:
        _kill_all(mark)
    assert first.returncode == 0 and second.returncode == 0, (err1, err2)
    assert err1.count("note: building DeepSpeed's stub_op op in ") == 1, err1
    assert "note: waiting for another process building in " in err2, err2
    third, _ = _start(GUARDED, tmp_path)
    _, err3 = third.communicate(timeout=pace.scaled(60))
    assert third.returncode == 0 and "note:" not in err3, err3


def test_a_failed_build_is_one_error_line_after_the_compiler_output(tmp_path):
    code = (
        "import sys; from frod_ds.runtime import op_build; from frod_ds.runtime.entry import run; "
        "from tests.support.stub_op import StubBuilder; "
        "sys.exit(run(lambda: op_build.load_op(StubBuilder()), init_group=False))"
    )
    proc, _ = _start(code, tmp_path, FROD_STUB_EXIT="3")
    _, err = proc.communicate(timeout=pace.scaled(60))
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert "stub_op" in errors[0] and "FAILED" in err, err  # ninja's own report of the failed command, above
