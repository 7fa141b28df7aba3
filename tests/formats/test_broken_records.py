"""An ownership record that is there but no record frod-ds can read (a link, a folder, a pipe, random text, JSON
Python cannot hold, JSON of another shape) shows nothing about who wrote its folder: a command replacing that folder
is refused in one line naming the record and what it is, not blamed on an older frod-ds, and nothing changes. A
record that reads but names no kind is the older frod-ds's, and says so."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from frod_ds.formats.building import building_dir
from frod_ds.formats.output_dir import MARKER
from frod_ds.formats.ownership import check_replaceable, remove_owned
from frod_ds.formats.record_check import record_problem
from frod_ds.runtime.errors import FrodError

BUILD = {"train.jsonl": "t\n", "manifest.json": "{}\n"}


def tree(root: Path) -> dict[str, str]:
    """Every entry under ``root``: files with the sha256 of their bytes, links with their target, folders empty."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_dir():
            out[rel + "/"] = ""
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[rel] = "special"
    return out


def built(out: Path) -> Path:
    with building_dir(out, "data-build") as tmp:
        for name, text in BUILD.items():
            (tmp / name).write_text(text)
    return out


def _link(record: Path, decoy: Path) -> None:
    record.unlink()
    record.symlink_to(decoy)


def _hard_link(record: Path, decoy: Path) -> None:
    record.unlink()
    os.link(decoy, record)


def _folder(record: Path, decoy: Path) -> None:
    record.unlink()
    record.mkdir()


def _pipe(record: Path, decoy: Path) -> None:
    record.unlink()
    os.mkfifo(record)


BROKEN = {  # how the record is broken → what the refusal calls it
    "link": (_link, "a symbolic link (to {decoy})"),
    "hard link to random text": (_hard_link, "not JSON frod-ds can read (Expecting value, line 1 column 1)"),
    "folder": (_folder, "a folder"),
    "pipe": (_pipe, "a named pipe (FIFO)"),
    "random text": (
        lambda r, d: r.write_text("qwertyuiop\n"),
        "not JSON frod-ds can read (Expecting value, line 1 column 1)",
    ),
    "huge integer": (lambda r, d: r.write_text("9" * 5000), "not JSON frod-ds can read ("),
    "list": (lambda r, d: r.write_text("[]"), "JSON but no ownership record (expected an object, got list)"),
    "bytes": (lambda r, d: r.write_bytes(b"\xff\xfe"), "not UTF-8 text (byte 0)"),
}


@pytest.mark.parametrize("how", sorted(BROKEN))
def test_a_broken_record_is_named_not_blamed_on_an_older_frod_ds(tmp_path, how):
    out = built(tmp_path / "build")
    decoy = tmp_path / "decoy.txt"
    decoy.write_text("not a record\n")
    breaks, says = BROKEN[how]
    breaks(out / MARKER, decoy)
    says = says.format(decoy=decoy)
    before = tree(tmp_path)
    with pytest.raises(FrodError) as e:
        check_replaceable(out, "data-build")
    line = str(e.value)
    assert line.startswith(f"--out {out}: its ownership record {out / MARKER} is {says}"), line
    assert "older frod-ds" not in line and "remove it yourself" not in line and "\n" not in line
    assert line.endswith(
        "refusing to replace it, choose a new directory (removing that file does not change this: frod-ds replaces "
        "only a folder it can show it wrote)"
    ), line
    with pytest.raises(FrodError, match="its ownership record"):
        remove_owned(out, "data-build")
    assert tree(tmp_path) == before


def test_a_broken_record_of_a_folder_its_writer_recognises_says_to_remove_that_file(tmp_path):
    """Where the command recognises its folders from before records, removing the broken record is the way on: the
    line says so, and without the record the folder is replaced as that older output."""
    out = built(tmp_path / "build")
    (out / MARKER).write_text("garbage")
    legacy = lambda p: (p / "train.jsonl").is_file()  # noqa: E731 - a writer's own recogniser, in short
    with pytest.raises(FrodError, match=r"remove that file and run the same command again \(.* then reads as a frod"):
        check_replaceable(out, "data-build", legacy=legacy)
    (out / MARKER).unlink()
    check_replaceable(out, "data-build", legacy=legacy)


def test_a_record_that_reads_but_names_no_kind_is_an_older_frod_ds(tmp_path):
    out = tmp_path / "old"
    out.mkdir()
    (out / MARKER).write_text(json.dumps({"format": "frod-ds-output"}))
    (out / "train.jsonl").write_text("t\n")
    assert record_problem(out) is None
    with pytest.raises(FrodError, match="holds a frod-ds marker with no kind"):
        check_replaceable(out, "data-build")


def test_a_readable_record_and_none_have_no_problem(tmp_path):
    assert record_problem(built(tmp_path / "build")) is None
    assert record_problem(tmp_path) is None


def test_a_record_that_cannot_be_opened_is_named_unreadable(tmp_path, monkeypatch):
    """A record this process may not read (another user's, mode 000: root reads it anyway, so the refusal to open
    it is staged): named as unreadable, with the reason."""
    out = built(tmp_path / "build")
    real_open = os.open

    def denied(path, *a, **kw):
        if Path(path).name == MARKER:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *a, **kw)

    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(FrodError, match=f"its ownership record {out / MARKER} is unreadable \\(permission denied\\)"):
        check_replaceable(out, "data-build")
