"""The earlier output a build replaces is moved aside into ``.<name>.old-<host>-<pid>-<random>`` and deleted after
the new one is published. A writer killed while deleting it leaves that folder; the next build of the same output on
this host finishes the job: what the old output's record lists is deleted, what appeared in it since is kept. Folders
of live writers, of other hosts, of a writer killed before the new output was in place, and anything else named
alike are left alone."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

from frod_ds.formats.building import building_dir
from frod_ds.formats.publish import aside_prefix
from tests.support.leftovers import REPO, clean_env

KILLED_WHILE_DELETING = """
import os, signal, sys
from pathlib import Path
from frod_ds.formats import publish
from frod_ds.formats.building import building_dir

def killed(old, kind):
    (old / "train.jsonl").unlink()  # part of the old output deleted
    (old / "notes.txt").write_text("mine")  # a user's file, written into it after it was checked
    os.kill(os.getpid(), signal.SIGKILL)

publish._discard = killed
with building_dir(Path(sys.argv[1]), "data-build") as tmp:
    (tmp / "train.jsonl").write_text("second")
"""


def build(out: Path, text: str) -> None:
    with building_dir(out, "data-build") as tmp:
        (tmp / "train.jsonl").write_text(text)
        (tmp / "manifest.json").write_text("{}")


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def killed_while_deleting(out: Path) -> tuple[Path, int]:
    """Replace ``out`` in a second process killed (SIGKILL) while deleting the old output: the folder it left."""
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WHILE_DELETING, str(out)],
        cwd=REPO,
        env={**clean_env(), "PYTHONPATH": str(REPO)},
        stderr=subprocess.PIPE,
        text=True,
    )
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -9, err[-2000:]
    (aside,) = [p for p in out.parent.iterdir() if p.name != out.name]
    return aside, proc.pid


def test_a_writer_killed_while_deleting_the_old_output_leaves_a_folder_naming_itself(tmp_path):
    out = tmp_path / "data"
    build(out, "first")
    aside, pid = killed_while_deleting(out)
    assert re.fullmatch(rf"\.data\.old-{re.escape(socket.gethostname())}-{pid}-[a-z0-9_]{{8}}", aside.name)
    assert (out / "train.jsonl").read_text() == "second"
    assert sorted(p.name for p in (aside / "data").iterdir()) == [".frod-ds-output", "manifest.json", "notes.txt"]


def test_the_next_build_finishes_a_dead_writers_replacement_and_leaves_the_rest(tmp_path, capsys):
    out = tmp_path / "data"
    build(out, "first")
    dead, _ = killed_while_deleting(out)
    host, gone = socket.gethostname(), dead_pid()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        others = {
            "live": tmp_path / f"{aside_prefix(out)}{live.pid}-abcd_123",
            "other host": tmp_path / f".data.old-{host}x-{gone}-abcd_123",
            "not frod-ds's name": tmp_path / f".data.old-{host}-{gone}-mine",
            "a user's folder": tmp_path / ".data.old-backup",
        }
        for d in others.values():
            (d / "data").mkdir(parents=True)
            (d / "data" / "train.jsonl").write_text("keep")
        build(out, "third")
    finally:
        live.kill()
        live.wait()
    assert (out / "train.jsonl").read_text() == "third"
    assert not dead.exists()
    assert all((d / "data" / "train.jsonl").read_text() == "keep" for d in others.values())
    (kept,) = [p for p in tmp_path.iterdir() if ".kept-" in p.name]
    assert sorted(p.name for p in kept.iterdir()) == ["notes.txt"] and "are kept in" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["data", kept.name, *(d.name for d in others.values())])


def test_a_dead_writers_aside_stays_while_the_output_it_replaced_is_missing(tmp_path):
    """Killed between moving the old output aside and putting the new one in place: the aside holds the only copy
    of the old output, and the next build leaves it."""
    out = tmp_path / "data"
    build(out, "first")
    aside = tmp_path / f"{aside_prefix(out)}{dead_pid()}-abcd_123"
    aside.mkdir()
    os.rename(out, aside / "data")
    build(out, "second")
    assert (aside / "data" / "train.jsonl").read_text() == "first"
    assert (out / "train.jsonl").read_text() == "second"
