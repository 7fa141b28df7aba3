"""``tests.support.ranks.run``: a command forked from the test process gives what the same command line gives in
a fresh interpreter (output, exit code, warnings, logging, exit handlers), and stops like torchrun."""

from __future__ import annotations

import atexit
import logging
import subprocess
import sys
import time

import pytest

from tests.support import pace, ranks
from tests.support.leftovers import REPO, clean_env

# Each line one write: two ranks share the pipe, and print() writes its pieces one by one, which interleave
# between processes where the output is unbuffered.
SCRIPT = """
import atexit, logging, os, sys, warnings
def line(*parts):
    sys.stdout.write(" ".join(map(str, parts)) + "\\n")
line("argv", sys.argv, "name", __name__, "cwd", os.getcwd())
line("env", os.environ.get("RANK"), os.environ.get("WORLD_SIZE"), os.environ.get("FROD_PROBE"))
line("path0", sys.path[0] == os.path.dirname(os.path.abspath(sys.argv[0])))
warnings.warn("a user warning")
warnings.warn("a deprecation", DeprecationWarning)
logging.getLogger("frod_probe_bound").warning("a log line")
atexit.register(lambda: line("the script's exit handler ran"))
print("to stderr", file=sys.stderr)
sys.exit(int(os.environ.get("FROD_PROBE_EXIT", "0")))
"""


def _fresh(cmd: list[str], env: dict[str, str], cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *cmd], env=env, cwd=cwd, capture_output=True, text=True, timeout=pace.scaled(120)
    )


@pytest.mark.parametrize("code", ["0", "3"])
def test_a_forked_command_prints_and_exits_as_a_fresh_interpreter_does(tmp_path, code):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    # state of this test process a fresh interpreter would not have: a handler bound to pytest's captured stderr,
    # an exit handler, a changed torch default
    bound = logging.getLogger("frod_probe_bound")
    handler = logging.StreamHandler(sys.stderr)
    bound.addHandler(handler)
    marker = tmp_path / "worker_exit_handler_ran"
    hook = lambda: marker.write_text("x")  # noqa: E731
    atexit.register(hook)
    import torch

    torch.set_default_dtype(torch.float64)
    try:
        env = clean_env(FROD_PROBE="yes", FROD_PROBE_EXIT=code)
        got = ranks.run(0, [str(script), "a", "b c"], env, tmp_path, timeout=120)
    finally:
        torch.set_default_dtype(torch.float32)
        atexit.unregister(hook)
        bound.removeHandler(handler)
    want = _fresh([str(script), "a", "b c"], env, tmp_path)
    assert (got.returncode, got.stdout, got.stderr) == (want.returncode, want.stdout, want.stderr)
    assert got.returncode == int(code) and "the script's exit handler ran" in got.stdout
    assert "a user warning" in got.stderr and "a log line" in got.stderr
    assert not marker.exists(), "the test process's exit handler ran in the forked command"


def test_a_forked_module_runs_as_python_dash_m_does(tmp_path):
    """``ranks.run(0, ["-m", MODULE, ...])``: ``__main__``, ``sys.argv[0]`` the module's file, the working folder
    first on ``sys.path``, as ``python -m MODULE`` gives them."""
    (tmp_path / "frod_probe_mod.py").write_text(SCRIPT)
    env = clean_env(FROD_PROBE="m")
    got = ranks.run(0, ["-m", "frod_probe_mod", "a"], env, tmp_path, timeout=120)
    want = _fresh(["-m", "frod_probe_mod", "a"], env, tmp_path)
    assert (got.returncode, got.stdout, got.stderr) == (want.returncode, want.stdout, want.stderr)
    assert "path0 True" in got.stdout and str(tmp_path / "frod_probe_mod.py") in got.stdout


def test_ranks_get_torchruns_environment_and_match_the_launcher_script(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    env = clean_env(FROD_PROBE="r")
    got = ranks.run(2, [str(script)], env, tmp_path, timeout=120)
    want = _fresh([str(REPO / "tests" / "support" / "ranks.py"), "2", str(script)], env, tmp_path)
    assert got.returncode == want.returncode == 0, got.stderr + want.stderr
    assert sorted(got.stdout.splitlines()) == sorted(want.stdout.splitlines())
    assert "env 0 2 r" in got.stdout and "env 1 2 r" in got.stdout


def test_a_failed_rank_stops_the_others_and_a_timeout_kills_them(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(3)\ntime.sleep(120)\n")
    t0 = time.monotonic()
    res = ranks.run(2, [str(script)], clean_env(), tmp_path, timeout=100)
    assert res.returncode == 3 and time.monotonic() - t0 < pace.scaled(30)  # rank 0 got SIGTERM, not its 120 s

    # past the time-out: SIGTERM first (the command cleans up, as under torchrun), then SIGKILL
    script.write_text(
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: (open('termed', 'w').close(), sys.exit(143)))\n"
        "print(os.getpid(), flush=True)\ntime.sleep(120)\n"
    )
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as e:
        ranks.run(0, [str(script)], clean_env(), tmp_path, timeout=2)
    assert time.monotonic() - t0 < pace.scaled(30) and (tmp_path / "termed").exists()
    pid = int(e.value.output.split()[0])
    with pytest.raises(ProcessLookupError):
        import os

        os.kill(pid, 0)
