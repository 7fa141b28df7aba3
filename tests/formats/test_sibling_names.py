"""An output path whose first part starts with ``~`` (no shell expanded it: quoted, or in a recipe) is refused where
every writer starts, its lease, before anything is made: frod-ds would take it for a folder named ``~`` here."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from frod_ds.formats.lease import acquire, holding
from frod_ds.formats.sibling_names import literal_home
from frod_ds.runtime.errors import FrodError


@pytest.mark.parametrize("out", ["~/run", "~", "~someone/ex"])
def test_an_output_starting_with_a_tilde_is_refused_before_anything_is_made(tmp_path, monkeypatch, out):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FrodError, match=r"output_dir .* starts with '~.*', which frod-ds takes literally"):
        acquire(Path(out), "run", "output_dir")
    with pytest.raises(FrodError, match=rf"--out {out} .*write the path out \({os.path.expanduser(out)}\)"):
        with holding(out, "export"):
            pass
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("out", ["runs/~x", "/abs/~", "a~b"])
def test_a_tilde_anywhere_but_the_start_is_an_ordinary_name(out):
    assert literal_home(Path(out), "--out") is None


def test_the_refusal_names_the_absolute_path_that_is_taken_for_a_folder_named_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    said = literal_home(Path("~/run"), "--out")
    assert said is not None and f"or {tmp_path / '~' / 'run'} for a folder really named so" in said
    assert literal_home(tmp_path / "~" / "run", "--out") is None


def test_convert_gguf_refuses_a_literal_tilde_output_as_every_writer_does(tmp_path, monkeypatch):
    """convert-gguf expanded its --out's ~ (its --gguf is an input: expanded), so one writer of eight wrote into
    the home folder a quoted ~/x named; it is refused before the GGUF is read."""
    from frod_ds.interop.gguf import ConvertError, convert_gguf

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ConvertError, match=r"--out ~/cv starts with '~', which frod-ds takes literally"):
        convert_gguf("~/m.gguf", "~/cv")
    assert sorted(p.name for p in (tmp_path / "home").iterdir()) == ["m.gguf"] and not (tmp_path / "~").exists()
