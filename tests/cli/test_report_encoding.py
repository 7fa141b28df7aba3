"""The command's report where stdout cannot take it: an ASCII stdout (``PYTHONIOENCODING=ascii``) prints what it
cannot encode escaped, exit 0; a full one (``> /dev/full``), also for ``--help`` and ``--version``, is one
``error:`` line and exit 2, buffered or not."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from frod_ds.runtime import entry
from tests.support import pace
from tests.support.leftovers import clean_env
from tests.support.model_shapes import LLAMA2_7B

REPO = Path(__file__).resolve().parents[2]
FULL_STDOUT_LINE = "error: cannot write the command's report to stdout: No space left on device"


def frod(*args: str, stdout=subprocess.PIPE, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "frod_ds", *args],
        cwd=REPO,
        env=clean_env(**env),
        stdout=stdout,
        stderr=subprocess.PIPE,
        timeout=pace.scaled(60),
    )


def no_traceback(proc: subprocess.CompletedProcess) -> str:
    err = proc.stderr.decode("ascii")  # an ASCII stderr got ASCII only
    assert "Traceback" not in err and "Exception ignored" not in err, err[-2000:]
    return err


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LLAMA2_7B))
    return d


def test_a_report_an_ascii_stdout_cannot_encode_is_printed_escaped(model_dir):
    proc = frod("plan", "--model", str(model_dir), "--gpus", "1", PYTHONIOENCODING="ascii")
    no_traceback(proc)
    assert proc.returncode == 0
    assert b"fastest set-up that fits: " in proc.stdout and b"\\u2014" in proc.stdout
    proc.stdout.decode("ascii")


@pytest.mark.parametrize("encoding", ["ascii", "ascii:strict"])
def test_an_error_line_an_ascii_stderr_cannot_encode_is_printed_escaped(tmp_path, encoding):
    missing = tmp_path / "modèle"
    proc = frod("plan", "--model", str(missing), "--gpus", "1", PYTHONIOENCODING=encoding)
    err = no_traceback(proc)
    assert proc.returncode == 2
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "mod\\xe8le" in lines[0], err


def test_run_script_escapes_only_while_the_command_runs(monkeypatch):
    """In-process callers get their streams back as they were: the escaping is the command's, not the process's."""
    out = io.TextIOWrapper(io.BytesIO(), encoding="ascii", write_through=True)
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(entry.os, "_exit", lambda code: None)
    entry.run_script(lambda: print("\u03c3 \u00d7 2") or 0, fast_exit=True)
    assert out.buffer.getvalue() == b"\\u03c3 \\xd7 2\n" and out.errors == "strict"


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["plan", "--help"], ["data", "build", "--help"]])
@pytest.mark.parametrize("buffered", [True, False])
def test_help_and_version_stdout_cannot_take_are_one_line(args, buffered):
    with open("/dev/full", "wb") as full:
        proc = frod(*args, stdout=full, PYTHONUNBUFFERED="" if buffered else "1")
    err = no_traceback(proc)
    assert proc.returncode == 2, err
    assert err.splitlines() == [x for x in err.splitlines() if x.startswith(FULL_STDOUT_LINE)] and err.count("\n") == 1


def test_a_buffered_report_stdout_cannot_take_is_one_line(model_dir):
    with open("/dev/full", "wb") as full:
        proc = frod("plan", "--model", str(model_dir), "--gpus", "1", stdout=full, PYTHONUNBUFFERED="")
    err = no_traceback(proc)
    assert proc.returncode == 2 and err.startswith(FULL_STDOUT_LINE) and err.count("\n") == 1, err


def test_help_and_version_still_print(model_dir):
    proc = frod("--version")
    assert proc.returncode == 0 and proc.stdout.startswith(b"frod-ds ")
    proc = frod("plan", "--help")
    assert proc.returncode == 0 and proc.stdout.startswith(b"usage: frod plan")
