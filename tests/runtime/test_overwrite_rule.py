"""The overwrite rule (``frod_ds.formats.ownership.check_replaceable``): ``--overwrite`` replaces only a directory an
earlier run of the same command wrote (the marker's kind), never one holding another command's output, never one of the
command's own inputs (or a directory containing or inside one), and training never writes into a directory that
frod-ds training did not write. Each refusal is exit 2 with one ``error:`` line, and the refused directory is
byte-identical afterwards. One tiny model, factor store, data build and trained run are shared by the module;
CLIs run in-process where they stop before a DeepSpeed engine, training and HJD as one-process subprocesses."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from frod_ds.formats.ownership import MARKER
from frod_ds.prep.command import main as data_prep_main
from launch import export as export_cli
from launch import hjd as hjd_cli
from tests.support.train_env import CPU_ZERO2, build_env, run_train, train_in_process


def tree(path: Path) -> dict[str, str]:
    """Every file under ``path`` (relative name → sha256 of its bytes): proof that nothing changed."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def one_error(capsys, code: int) -> str:
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def proc_error(proc) -> str:
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


def train_proc(env, out: Path, *extra: str):
    overrides = env.overrides(out, **{"train.max_steps": 2, "train.save_every": 0})
    return run_train(CPU_ZERO2, [*overrides, *extra], nproc=0)


def marked(path: Path, kind: str | None, files: dict[str, str] | None = None) -> Path:
    """A directory with a marker of ``kind`` (None: an old marker without one) and ``files``."""
    path.mkdir(parents=True)
    record = {"format": "frod-ds-output"} if kind is None else {"format": "frod-ds-output", "kind": kind}
    (path / MARKER).write_text(json.dumps(record) + "\n")
    for name, text in (files or {"keep.txt": "keep"}).items():
        (path / name).write_text(text)
    return path


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return build_env(tmp_path_factory.mktemp("overwrite_rule"))


@pytest.fixture(scope="module")
def run(env):
    out = env.root / "run"
    proc = train_proc(env, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def adapter(run):
    return run / "adapter-final"


@pytest.fixture(scope="module")
def hf_export(env, adapter):
    out = env.root / "hf-export"
    assert export_cli.main(["--checkpoint", str(adapter), "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def peft_export(env, adapter):
    out = env.root / "peft-export"
    assert export_cli.main(["--checkpoint", str(adapter), "--out", str(out), "--format", "peft"]) == 0
    return out


def refuse_export(capsys, argv: list[str], victim: Path) -> str:
    """``launch/export.py ARGV --overwrite`` is refused and ``victim`` is byte-identical afterwards."""
    before = tree(victim)
    line = one_error(capsys, export_cli.main([*argv, "--overwrite"]))
    assert tree(victim) == before
    assert str(victim) in line or victim.name in line, line
    return line


# -- an export never replaces its own input --------------------------------------------------------------


def test_export_onto_its_own_checkpoint_is_refused(adapter, capsys):
    line = refuse_export(capsys, ["--checkpoint", str(adapter), "--out", str(adapter)], adapter)
    assert "--checkpoint" in line and "trained adapter" in line


def test_export_inside_its_own_checkpoint_is_refused(adapter, capsys):
    line = refuse_export(capsys, ["--checkpoint", str(adapter), "--out", str(adapter / "merged")], adapter)
    assert "inside" in line
    assert not (adapter / "merged").exists()


def test_export_onto_the_run_holding_its_checkpoint_is_refused(run, capsys):
    refuse_export(capsys, ["--checkpoint", str(run / "adapter-final"), "--out", str(run)], run)


def test_export_onto_a_demo_directory_is_refused(env, run, tmp_path, capsys):
    """``make demo``'s directory (marker kind ``demo``: model, store, data, checkpoints, adapters)."""
    demo = tmp_path / "demo"
    shutil.copytree(run, demo)
    (demo / MARKER).write_text(json.dumps({"format": "frod-ds-output", "kind": "demo"}) + "\n")
    line = refuse_export(capsys, ["--checkpoint", str(run / "adapter-final"), "--out", str(demo)], demo)
    assert "demo" in line


# -- --overwrite replaces only an earlier output of the same command --------------------------------------


def test_peft_export_over_a_data_build_is_refused(env, adapter, capsys):
    line = refuse_export(capsys, ["--checkpoint", str(adapter), "--format", "peft", "--out", str(env.data)], env.data)
    assert "frod data build" in line


def test_peft_import_over_an_hf_export_is_refused(env, peft_export, hf_export, capsys):
    line = refuse_export(
        capsys, ["--from-peft", str(peft_export), "--base-model", str(env.model), "--out", str(hf_export)], hf_export
    )
    assert "Hugging Face export" in line


def test_hf_export_over_a_peft_export_is_refused(adapter, peft_export, capsys):
    line = refuse_export(capsys, ["--checkpoint", str(adapter), "--out", str(peft_export)], peft_export)
    assert "PEFT" in line


@pytest.mark.parametrize(
    "kind,needle",
    [
        (None, "no kind"),
        ("output", "unknown kind"),
        ("adapter", "trained adapter"),
        ("factor-store", "factor store"),
        ("training-run", "training run"),
    ],
)
def test_export_trusts_a_marker_only_of_its_own_kind(adapter, tmp_path, capsys, kind, needle):
    victim = marked(tmp_path / "victim", kind)
    line = refuse_export(capsys, ["--checkpoint", str(adapter), "--out", str(victim)], victim)
    assert needle in line


def test_export_refuses_its_own_kind_holding_an_adapter(adapter, tmp_path, capsys):
    victim = marked(tmp_path / "victim", "hf-export")
    shutil.copytree(adapter, victim / "kept" / "adapter-final")
    line = refuse_export(capsys, ["--checkpoint", str(adapter), "--out", str(victim)], victim)
    assert "adapter-final" in line


def test_export_still_replaces_its_own_earlier_export(adapter, tmp_path, capsys):
    out = tmp_path / "merged"
    args = ["--checkpoint", str(adapter), "--out", str(out)]
    assert export_cli.main(args) == 0
    assert export_cli.main([*args, "--overwrite"]) == 0
    assert json.loads((out / MARKER).read_text())["kind"] == "hf-export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]


@pytest.mark.parametrize("edited", ["adapter/adapter_config.json", "factor-store/manifest.json"])
def test_an_edit_inside_a_nested_output_is_refused_by_overwrite(env, peft_export, tmp_path, capsys, edited):
    """A PEFT import holds its adapter and factor store as outputs of their own (each with its record; the store's
    files stamped when the import is published, as HJD leaves them unstamped): a user's edit inside either is refused
    by ``--overwrite`` as an edit at the top is, and kept (it was deleted with the rest)."""
    out = tmp_path / "imp"
    args = ["--from-peft", str(peft_export), "--base-model", str(env.model), "--out", str(out)]
    assert export_cli.main(args) == 0
    (out / edited).write_text((out / edited).read_text() + " \n")
    before = tree(out)
    line = one_error(capsys, export_cli.main([*args, "--overwrite"]))
    assert f"holds files changed since frod-ds wrote them: {edited}" in line, line
    assert tree(out) == before
    (out / edited).write_text((out / edited).read_text()[:-2])  # the edit undone: the import replaces its own
    assert export_cli.main([*args, "--overwrite"]) == 0


def test_data_build_over_a_factor_store_is_refused(env, tmp_path, capsys):
    store = tmp_path / "store"
    shutil.copytree(env.store, store)  # holds a manifest.json, as a data build does
    (store / MARKER).write_text(json.dumps({"format": "frod-ds-output", "kind": "factor-store"}) + "\n")
    before = tree(store)
    line = one_error(
        capsys,
        data_prep_main(
            ["build", "--source", str(env.root / "raw"), "--tasks", "boolq", "--out", str(store), "--overwrite"]
        ),
    )
    assert "factor store" in line
    assert tree(store) == before


def test_hjd_over_a_data_build_is_refused(env, capsys):
    before = tree(env.data)
    line = one_error(capsys, hjd_cli.main(["--model", str(env.model), "--out", str(env.data), "--overwrite"]))
    assert "frod data build" in line
    assert tree(env.data) == before


# -- training writes only into its own run ----------------------------------------------------------------


def test_training_into_a_foreign_directory_is_refused_before_writing(env, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "recipe.yaml").write_text("my: own recipe\n")
    (mine / "metrics.jsonl").write_text('{"epoch": 1, "acc": 0.5}\n')
    before = tree(mine)
    overrides = env.overrides(mine, **{"train.max_steps": 2, "train.save_every": 0})
    line = proc_error(train_in_process(CPU_ZERO2, overrides))  # refused before the engine: no subprocess needed
    assert "output_dir" in line and "not written by frod-ds" in line
    assert tree(mine) == before and sorted(p.name for p in mine.iterdir()) == ["metrics.jsonl", "recipe.yaml"]


def test_training_run_dir_is_recognised_with_or_without_its_marker(env, run, tmp_path):
    """Re-running the same command resumes (tests/cli/test_bad_inputs.py runs it); a run from before the marker is
    recognised by its checkpoints or adapters."""
    from frod_ds.train.trainer import check_run_dir

    assert json.loads((run / MARKER).read_text())["kind"] == "training-run"
    check_run_dir(run)
    old = tmp_path / "old-run"
    shutil.copytree(run, old)
    (old / MARKER).unlink()
    check_run_dir(old)


def test_a_build_killed_with_sigkill_is_swept_by_the_next_build_of_that_output(tmp_path):
    """A builder killed with SIGKILL leaves its temporary sibling (a merged export: the model's size); the next
    build of the same output deletes it when its process, on this host, is gone, and leaves live builds, other
    hosts' builds and other outputs' alone."""
    import socket
    import subprocess
    import sys

    from frod_ds.formats.building import building_dir
    from frod_ds.formats.ownership import mark_dir, marker_kind

    out = tmp_path / "export"
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed.kill()
    killed.wait()
    host = socket.gethostname()
    leftovers = {  # named as building_dir names them: host, pid, mkdtemp's 8 random characters
        "dead": tmp_path / f".export.tmp-{host}-{killed.pid}-abc_1234",
        "live": tmp_path / f".export.tmp-{host}-{os.getpid()}-def_1234",
        "other host": tmp_path / f".export.tmp-{host}x-{killed.pid}-ghi_1234",
        "other host extending this one's name": tmp_path / f".export.tmp-{host}-12-{killed.pid}-ghi_5678",
        "other output": tmp_path / f".export2.tmp-{host}-{killed.pid}-jkl_1234",
        "dead, a user's (no record)": tmp_path / f".export.tmp-{host}-{killed.pid}-mno_1234",
    }
    for name, d in leftovers.items():
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"\0" * 10)
        if "a user's" not in name:
            mark_dir(d, "hf-export")  # as a build's folder holds from its start
    with building_dir(out, "hf-export") as tmp:
        assert tmp.name.startswith(f".export.tmp-{host}-{os.getpid()}-")
        assert marker_kind(tmp) == "hf-export"  # a build killed now leaves a folder the next one can tell
        (tmp / "config.json").write_text("{}")
    assert (out / "config.json").is_file()
    assert {k for k, d in leftovers.items() if not d.exists()} == {"dead"}


@pytest.mark.parametrize("edited", [False, True])
def test_an_unstamped_record_of_a_published_output_refuses_a_file_changed_after_it(tmp_path, edited):
    """A data build whose record holds no stamps (an older frod-ds's, or stamps removed): ``--overwrite`` removes
    it whole when untouched, and refuses, naming it, a listed file modified after the record was written."""
    import time

    from frod_ds.formats.ownership import mark_dir, remove_owned
    from frod_ds.runtime.errors import FrodError

    out = tmp_path / "d"
    (out / "eval").mkdir(parents=True)
    for name in ("train.jsonl", "manifest.json", "eval/boolq.jsonl"):
        (out / name).write_text("{}\n")
    mark_dir(out, "data-build", ["train.jsonl", "manifest.json", "eval/boolq.jsonl"])  # no stamps
    if not edited:
        remove_owned(out, "data-build")
        assert not out.exists()
        return
    time.sleep(0.01)
    (out / "manifest.json").write_text('{"mine": 1}\n')
    with pytest.raises(FrodError, match="changed since frod-ds wrote them: manifest.json; refusing"):
        remove_owned(out, "data-build")
    assert (out / "manifest.json").read_text() == '{"mine": 1}\n'


def test_a_full_disk_at_a_builds_first_record_leaves_no_folder_beside_the_output(tmp_path, monkeypatch):
    """The record a build's temporary holds from its start is its first write: a full disk there is said as one
    and the temporary goes (left, unrecorded, no later build would sweep it)."""
    import errno

    from frod_ds.formats import building
    from frod_ds.runtime.errors import FrodError

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(building, "mark_dir", full)
    with pytest.raises(FrodError, match=r"cannot write .*/export: No space left on device"):
        with building.building_dir(tmp_path / "export", "hf-export"):
            pass
    assert list(tmp_path.iterdir()) == []
