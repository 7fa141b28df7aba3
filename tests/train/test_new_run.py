"""``train.new_run`` moves the previous run into ``superseded-<time>/``: a name already taken there (an earlier
run's of the same second, a user's folder, file or link) is never filled or claimed; the next free name is."""

from __future__ import annotations

import json
import time

from frod_ds.formats.output_dir import read_record
from frod_ds.formats.ownership import record_files
from frod_ds.train import run_dir


def test_new_run_takes_a_free_superseded_name_and_leaves_a_users_one_alone(tmp_path, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    record_files(out, run_dir.RUN_FILES, run_dir.RUN_KIND)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "adapter-final").mkdir()
    (out / "adapter-final" / "adapter.safetensors").write_text("weights\n")
    record_files(out, ["adapter-final/"], run_dir.RUN_KIND)
    stamp = "superseded-20261130-120000"
    monkeypatch.setattr(time, "strftime", lambda fmt, *a: stamp)
    users = tmp_path / "users"
    users.mkdir()
    (out / stamp).mkdir()  # the user's folder of that name
    (out / stamp / "notes.txt").write_text("mine\n")
    (out / f"{stamp}-1").symlink_to(users, target_is_directory=True)  # a link to a user's folder
    (out / f"{stamp}-2").write_text("a file\n")
    run_dir._supersede_previous_run(out)
    dest = out / f"{stamp}-3"
    assert sorted(p.name for p in dest.iterdir()) == ["adapter-final", "metrics.jsonl"]
    assert (out / stamp / "notes.txt").read_text() == "mine\n" and sorted(p.name for p in (out / stamp).iterdir()) == [
        "notes.txt"
    ]
    assert list(users.iterdir()) == [] and (out / f"{stamp}-2").read_text() == "a file\n"
    files = read_record(out).files
    assert f"{stamp}-3/" in files and not {f"{stamp}/", f"{stamp}-1/", f"{stamp}-2/"} & set(files), json.dumps(files)


def test_new_run_with_a_mount_point_among_the_runs_folders_moves_nothing(tmp_path, monkeypatch):
    """A folder of the run that is a mount point (a read-only bind mount of checkpoints/; the kernel refuses to
    rename one): refused in one line naming it before anything moves; nothing half moved."""
    import os

    import pytest

    from frod_ds.runtime.errors import FrodError

    out = tmp_path / "run"
    out.mkdir()
    record_files(out, run_dir.RUN_FILES, run_dir.RUN_KIND)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "checkpoints").mkdir()
    (out / "adapter-final").mkdir()
    record_files(out, ["adapter-final/"], run_dir.RUN_KIND)
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: str(p) == str(out / "checkpoints") or real(p))
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(FrodError, match=r"checkpoints is a mount point .*choose another output_dir \(nothing was"):
        run_dir._supersede_previous_run(out)
    assert sorted(p.name for p in out.iterdir()) == before
