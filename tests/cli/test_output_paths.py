"""An output path with ``..`` in it through a folder that is not there yet (``./d/../d``, ``new/../out``) names the
place the kernel would make of it once its parts exist: the writer builds beside that and publishes it (it built
beside ``d/..``, which cannot be resolved while ``d`` is missing, and ended with a traceback and two leftovers)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from frod_ds.prep.command import main as data_main
from frod_ds.runtime.cli_parser import output_path

MIRROR = Path(__file__).parents[1] / "fixtures" / "data_prep" / "mirror"


@pytest.mark.parametrize(
    ("given", "want"),
    [
        ("a/b", "a/b"),  # no ..: as given
        ("./d/../d", "{cwd}/d"),
        ("new/../out", "{cwd}/out"),
        ("../up/z", "{parent}/up/z"),
        ("~/x/../y", "~/x/../y"),  # a literal ~: refused where it is leased, as given
    ],
)
def test_dots_in_an_output_are_resolved_where_the_kernel_would(tmp_path, monkeypatch, given, want):
    monkeypatch.chdir(tmp_path)
    assert output_path(given) == want.format(cwd=os.path.realpath(tmp_path), parent=os.path.realpath(tmp_path.parent))


def test_a_link_before_the_dots_is_followed_as_the_kernel_follows_it(tmp_path, monkeypatch):
    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real" / "sub")
    monkeypatch.chdir(tmp_path)
    assert output_path("link/../out") == str(tmp_path.resolve() / "real" / "out")


def test_data_build_through_a_folder_not_made_yet_writes_the_output_and_nothing_else(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert data_main(["build", "--source", str(MIRROR), "--tasks", "boolq", "--out", "./d/../d"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"] and (tmp_path / "d" / "train.jsonl").is_file()


def test_dots_after_a_file_are_refused_as_the_kernel_refuses_them(tmp_path, monkeypatch, capsys):
    """``decoy/../out`` where ``decoy`` is a user's file: the kernel cannot walk through a file, so the output is not
    taken for ``out``; the command stops in one line naming the path, the file untouched and nothing written."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "decoy").write_text("mine")
    assert output_path("decoy/../out") == "decoy/../out"
    assert data_main(["build", "--source", str(MIRROR), "--tasks", "boolq", "--out", "decoy/../out"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "decoy" in err[-1] and "file" in err[-1], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decoy"] and (tmp_path / "decoy").read_text() == "mine"


def test_the_demo_refuses_dots_after_a_file_too(tmp_path, monkeypatch, capsys):
    """``frod demo --out decoy/../out`` (the demo resolves its output to hand it to its stages): one line naming the
    file, nothing written."""
    from frod_ds.cli.demo import main as demo_main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "decoy").write_text("mine")
    assert demo_main(["--out", "decoy/../out", "--ranks", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "error: cannot create decoy/../out: decoy is a file, not a directory; choose another --out", err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decoy"] and (tmp_path / "decoy").read_text() == "mine"
