"""A folder of a step's name under ``checkpoints/`` is pruned, or cleared before a save, only when it is one of
the run's saves: nothing in it but what a save writes and, once sealed, a trainable state of its own step. A user's
folder (notes beside the files), or a copy of a checkpoint under another step's name, is left alone with a note,
and a user's folder where a save is due stops the run in one line (it resumes once the folder is moved)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from frod_ds.runtime.errors import FrodError
from frod_ds.train import engine_state
from frod_ds.train.checkpoints import COMPLETE, foreign_files, tag_of
from frod_ds.train.trainable_state import FORMAT, TRAINABLE_STATE, TrainableState, write_state

OWN = (TRAINABLE_STATE, "run_identity.json", "factor_store.json")


def _save(root: Path, step: int) -> Path:
    """A step folder with the files a save writes (their contents stand-ins), sealed."""
    ckpt = root / tag_of(step)
    ckpt.mkdir(parents=True)
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt", "rng_rank0.pt"):
        torch.save({"step": step}, ckpt / name)
    meta = TrainableState(FORMAT, step, step, 1, 1, 1, 2, [1e-3], {}, step, 0)
    write_state(ckpt / TRAINABLE_STATE, {"x": torch.ones(2)}, meta)
    for name in OWN[1:]:
        (ckpt / name).write_text("{}\n")
    (ckpt / COMPLETE).write_text("")
    return ckpt


def test_only_the_runs_own_step_folders_are_pruned(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    mine = _save(root, 10)
    assert foreign_files(mine, OWN) == [] and engine_state._the_runs(mine, OWN, sealed=True)
    copy = root / tag_of(11)
    shutil.copytree(mine, copy)  # a user's backup under the next step's name
    assert not engine_state._the_runs(copy, OWN, sealed=True)
    assert "its trainable state is of step 10 (a copy?)" in capsys.readouterr().err
    users = root / tag_of(99)
    users.mkdir()
    (users / "notes.txt").write_text("mine\n")
    assert foreign_files(users, OWN) == ["notes.txt"]
    assert not engine_state._the_runs(users, OWN, sealed=False)
    assert f"{users} is left alone, not pruned: it holds what no save writes (notes.txt)" in capsys.readouterr().err
    # a .pt file no save names (round 30: a user's step folder of mine.pt, a backup/ folder in a save, went)
    (users / "notes.txt").unlink()
    (users / "mine.pt").write_text("mine\n")
    (mine / "backup").mkdir()
    torch.save({}, mine / "backup" / "mp_rank_00_model_states.pt")
    assert foreign_files(users, OWN) == ["mine.pt"] and not engine_state._the_runs(users, OWN, sealed=False)
    assert foreign_files(mine, OWN) == ["backup/mp_rank_00_model_states.pt"]
    shutil.rmtree(mine / "backup")
    capsys.readouterr()
    leftover = root / tag_of(20)
    leftover.mkdir()
    torch.save({}, leftover / "mp_rank_00_model_states.pt")
    (leftover / "rng_rank0.pt.frod-tmp").write_text("")
    assert engine_state._the_runs(leftover, OWN, sealed=False)


def test_a_users_folder_where_a_save_is_due_stops_the_run_and_is_kept(tmp_path):
    root = tmp_path / "checkpoints"
    users = root / tag_of(30)
    users.mkdir(parents=True)
    (users / "notes.txt").write_text("mine\n")
    with pytest.raises(FrodError, match=r"step00000030 is in the way of step 30's checkpoint .*\(notes.txt\)"):
        engine_state._clear_step_dir(users, OWN, 30)
    assert (users / "notes.txt").read_text() == "mine\n"
    link = root / tag_of(40)
    link.symlink_to(users, target_is_directory=True)
    with pytest.raises(FrodError, match=r"holds what no save writes \(step00000040\)"):
        engine_state._clear_step_dir(link, OWN, 40)
    assert (users / "notes.txt").is_file()
    killed = _save(root, 50)
    (killed / COMPLETE).unlink()
    engine_state._clear_step_dir(killed, OWN, 50)  # a save killed there before: cleared
    assert not killed.exists()


def test_a_removal_killed_part_way_leaves_a_folder_the_next_save_reclaims(tmp_path, monkeypatch):
    """A save's folder is removed seal first: a kill inside the removal leaves an unsealed leftover, which later
    saves reclaim. A sealed folder whose files an older removal took first (the seal kept, the trainable state
    gone) is the run's own too and is pruned, not left alone for good."""
    root = tmp_path / "checkpoints"
    ckpt = _save(root, 10)
    real = shutil.rmtree

    def killed(path, ignore_errors=False):  # the removal's first file deleted, then the process is gone
        Path(path, "rng_rank0.pt").unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(engine_state.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        engine_state._remove_save(ckpt)
    monkeypatch.setattr(engine_state.shutil, "rmtree", real)
    assert ckpt.is_dir() and not (ckpt / COMPLETE).exists()
    assert engine_state._the_runs(ckpt, OWN, sealed=False)  # an unsealed leftover: reclaimed
    half = _save(root, 20)
    for name in (TRAINABLE_STATE, "rng_rank0.pt"):  # an older frod-ds's removal, files first, cut short
        (half / name).unlink()
    assert engine_state._the_runs(half, OWN, sealed=True)


def test_pruning_keeps_the_newest_saves_and_reclaims_only_the_runs_leftovers(tmp_path):
    """The newest ``keep`` sealed saves stay, older ones and killed saves' leftovers go; a user's empty folder of a
    step's name (a placeholder) is kept, as is a folder holding what no save writes."""
    root = tmp_path / "checkpoints"
    for step in (10, 20, 30):
        _save(root, step)
    leftover = _save(root, 25)
    (leftover / COMPLETE).unlink()
    placeholder = root / tag_of(77)
    placeholder.mkdir()
    users = root / tag_of(5)
    users.mkdir()
    (users / "notes.txt").write_text("mine\n")
    engine_state.prune(root, tag_of(30), OWN, keep=2)
    assert sorted(p.name for p in root.iterdir()) == sorted(tag_of(s) for s in (5, 20, 30, 77))
    assert (users / "notes.txt").read_text() == "mine\n"


def test_a_users_file_at_a_profiles_name_is_left_as_it_is(tmp_path, capsys):
    from frod_ds.train.profile import profile_path, profiled

    theirs = profile_path(tmp_path, 3, 0)
    theirs.parent.mkdir()
    theirs.write_text("my notes\n")
    with profiled(tmp_path, 3, 0, True):
        sum(range(1000))
    assert theirs.read_text() == "my notes\n" and "is not a profile this run wrote" in capsys.readouterr().err
    with profiled(tmp_path, 4, 0, True):  # a free name, and then its own earlier profile: written
        sum(range(1000))
    with profiled(tmp_path, 4, 0, True):
        sum(range(1000))
    assert profile_path(tmp_path, 4, 0).read_text().startswith("rank 0, optimizer step 4: ")
