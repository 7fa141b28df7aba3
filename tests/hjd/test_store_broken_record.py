"""A factor store whose ownership record is no record frod-ds can read (random text, a link): ``frod hjd`` into it
names the record and what it is, in one line, and changes nothing; without that file the store reads as one from
before records, and the same command finds it complete."""

from __future__ import annotations

import pytest

from frod_ds.formats.output_dir import MARKER
from launch.hjd import main
from tests.support.helpers_ckpt import write_tiny_llama


def _files(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("how", ["random text", "link"])
def test_hjd_names_a_broken_record_of_its_store(tmp_path, capsys, how):
    model = write_tiny_llama(tmp_path / "model")
    out = tmp_path / "store"
    assert main(["--model", str(model), "--out", str(out), "--device", "cpu"]) == 0
    record = out / MARKER
    record.unlink()
    if how == "link":
        (tmp_path / "decoy").write_text("x")
        record.symlink_to(tmp_path / "decoy")
        says = f"a symbolic link (to {tmp_path / 'decoy'})"
    else:
        record.write_text("qwertyuiop")
        says = "not JSON frod-ds can read (Expecting value, line 1 column 1)"
    before = _files(out)
    capsys.readouterr()
    assert main(["--model", str(model), "--out", str(out), "--device", "cpu"]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error: ")]
    assert line == (
        f"error: --out {out}: its ownership record {record} is {says}, not the small JSON file frod-ds writes; "
        "remove it and run the same command again"
    ), line
    assert _files(out) == before
    record.unlink()
    assert main(["--model", str(model), "--out", str(out), "--device", "cpu"]) == 0
