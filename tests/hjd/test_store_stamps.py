"""A complete factor store's record stamps the files it names (``manifest.json``, each ``V``): a user's edit of
them is refused by the next run that would write over it, ``--overwrite`` or an added category alike, and
leaves the store as it was; HJD's own rewrites (an added category, a replacement) are stamped anew."""

from __future__ import annotations

import hashlib
import json

import pytest

from frod_ds.formats.output_dir import MARKER
from frod_ds.model.store_reader import FactorStore
from launch.hjd import main
from tests.support.helpers_ckpt import write_tiny_llama


@pytest.fixture
def model(tmp_path):
    return write_tiny_llama(tmp_path / "model")


def _files(root):
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*")}


def _hjd(model, out, *extra) -> int:
    return main(["--model", str(model), "--out", str(out), "--device", "cpu", *extra])


def _error_line(capsys) -> str:
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error: ")]
    return line


def _stamped(out) -> set[str]:
    return set(json.loads((out / MARKER).read_text()).get("written") or {})


def test_a_complete_store_stamps_its_manifest_and_v_files(model, tmp_path):
    out = tmp_path / "store"
    assert _hjd(model, out, "--categories", "q_proj") == 0
    assert _stamped(out) == set()  # a store still to extend: unstamped
    assert _hjd(model, out) == 0
    store = FactorStore.open(out)
    assert store.complete
    want = {"manifest.json", *(p.name for p in out.glob("*.V.safetensors"))}
    assert len(want) == 1 + len(store.manifest.targets) and _stamped(out) == want


@pytest.mark.parametrize("how", ["overwrite", "redo"])
def test_an_edited_manifest_is_refused_and_kept(model, tmp_path, capsys, how):
    """The run that would replace ``manifest.json`` (``--overwrite``, or a rerun redoing a category whose files
    went missing) refuses a user's edit of it, naming it, and changes nothing; with the edit undone it runs."""
    out = tmp_path / "store"
    assert _hjd(model, out) == 0
    if how == "redo":
        (out / "k_proj.V.safetensors").unlink()
    manifest = out / "manifest.json"
    manifest.write_text(manifest.read_text() + " \n")
    before = _files(out)
    again = ["--overwrite"] if how == "overwrite" else []
    capsys.readouterr()
    assert _hjd(model, out, *again) == 2
    line = _error_line(capsys)
    assert "changed since frod" in line and "manifest.json" in line and "move them out" in line, line
    assert _files(out) == before
    manifest.write_text(manifest.read_text()[:-2])  # the edit undone
    assert _hjd(model, out, *again) == 0
    assert FactorStore.open(out).complete and "manifest.json" in _stamped(out)
    assert (out / "k_proj.V.safetensors").is_file()


def test_a_noop_run_keeps_the_stamps_and_a_replacement_stamps_anew(model, tmp_path):
    out = tmp_path / "store"
    assert _hjd(model, out) == 0
    record = (out / MARKER).read_text()
    before = _files(out)
    assert _hjd(model, out) == 0  # nothing to do: the store and its record as they were
    assert _files(out) == before and (out / MARKER).read_text() == record
    assert _hjd(model, out, "--pi", "0.01", "--overwrite") == 0  # HJD's own rewrite is no user's edit
    assert FactorStore.open(out).complete and (out / MARKER).read_text() != record
    assert _hjd(model, out, "--pi", "0.02", "--overwrite") == 0


def test_an_edited_v_file_is_refused_by_a_rerun_that_redoes_another_category(model, tmp_path, capsys):
    """A ``V`` the user replaced in a complete store: the rerun that redoes a missing category (and rewrites the
    manifest that vouches for that ``V``) refuses and names it, as ``--overwrite`` does."""
    out = tmp_path / "store"
    assert _hjd(model, out) == 0
    v = out / "q_proj.V.safetensors"
    v.write_bytes(v.read_bytes() + b"\0")
    (out / "k_proj.V.safetensors").unlink()
    before = _files(out)
    capsys.readouterr()
    assert _hjd(model, out) == 2
    assert "q_proj.V.safetensors" in _error_line(capsys)
    assert _files(out) == before


def test_a_complete_store_left_unstamped_is_stamped_by_the_next_run(model, tmp_path):
    """A run killed between the store's last manifest write and its stamps (or a store built before stamps) is
    complete and unstamped: the next run, which has nothing to do, stamps it, so a later edit is refused."""
    out = tmp_path / "store"
    assert _hjd(model, out) == 0
    record = json.loads((out / MARKER).read_text())
    (out / MARKER).write_text(json.dumps({k: v for k, v in record.items() if k != "written"}))
    before = {k: v for k, v in _files(out).items() if k != MARKER}
    assert _hjd(model, out) == 0
    assert {k: v for k, v in _files(out).items() if k != MARKER} == before and "manifest.json" in _stamped(out)
