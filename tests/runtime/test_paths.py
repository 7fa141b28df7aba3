"""A path given on the command line is named for what it is (``frod_ds.runtime.paths``): a symbolic-link loop, a
broken link or a named pipe is not "not found", by every reader of data, models and stores. Which kind of folder a
directory is: tests/formats/test_folders.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from frod_ds.runtime.paths import dir_problem, file_problem


@pytest.fixture
def odd(tmp_path: Path) -> Path:
    """A regular file, a directory, a named pipe, a two-link loop and a broken link."""
    (tmp_path / "file.jsonl").write_text("{}\n")
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "pipe")
    os.symlink(tmp_path / "loop_b", tmp_path / "loop_a")
    os.symlink(tmp_path / "loop_a", tmp_path / "loop_b")
    os.symlink(tmp_path / "gone", tmp_path / "broken")
    return tmp_path


def test_file_problem_names_what_the_path_is(odd: Path) -> None:
    assert file_problem(odd / "file.jsonl") is None
    assert "symbolic-link loop" in file_problem(odd / "loop_a")
    assert "named pipe" in file_problem(odd / "pipe")
    assert "broken symbolic link" in file_problem(odd / "broken") and str(odd / "gone") in file_problem(odd / "broken")
    assert "is a directory" in file_problem(odd / "dir")
    assert file_problem(odd / "absent") == f"{odd / 'absent'} does not exist"
    assert "not found" not in " ".join(file_problem(odd / k) for k in ("loop_a", "pipe", "broken"))


def test_dir_problem_names_what_the_path_is(odd: Path) -> None:
    assert dir_problem(odd / "dir") is None
    assert "symbolic-link loop" in dir_problem(odd / "loop_a")
    assert "named pipe (FIFO), not a directory" in dir_problem(odd / "pipe")
    assert "is a file, not a directory" in dir_problem(odd / "file.jsonl")


@pytest.mark.parametrize("name, says", [("pipe", "named pipe"), ("loop_a", "symbolic-link loop")])
def test_readers_of_data_models_and_stores_name_a_pipe_or_a_link_loop(odd: Path, name: str, says: str) -> None:
    """Each reader that used to answer "not found" (or try the Hub) for a named pipe or a link loop names it."""
    from frod_ds.eval.run import load_task_rows
    from frod_ds.io.model_dir import resolve_model_dir
    from frod_ds.model.store_reader import FactorStore
    from frod_ds.prep.sources import check_local_tasks
    from frod_ds.runtime.errors import FrodError
    from frod_ds.train.data import training_file

    path = odd / name
    for call in (
        lambda: training_file(path),
        lambda: resolve_model_dir(str(path)),
        lambda: FactorStore.open(path),
        lambda: load_task_rows(str(path), "boolq", None),
        lambda: check_local_tasks(path, ["boolq"]),
    ):
        with pytest.raises(FrodError) as err:
            call()
        assert says in str(err.value) and "not found" not in str(err.value), str(err.value)


def test_unmovable_names_a_file_the_mount_table_lists_and_a_mount_point(tmp_path, monkeypatch):
    """A file bind-mounted on its own file system (``os.path.ismount`` says no: same device) is named from the
    mount table, its octal escapes read (a space is ``\\040`` there); a plain folder and file are movable."""
    from frod_ds.runtime import paths

    (tmp_path / "my dir").mkdir()
    bound = tmp_path / "my dir" / "q.V.safetensors"
    bound.write_text("x")
    (tmp_path / "plain").write_text("y")
    table = f"36 35 98:0 / {str(bound).replace(' ', chr(92) + '040')} rw,noatime master:1 - ext4 /dev/root rw\n"
    monkeypatch.setattr(paths.Path, "read_text", lambda self, *a, **k: table)
    assert paths._mount_points() == {str(bound)}
    assert paths.unmovable([tmp_path / "plain", tmp_path / "my dir"], tmp_path) is None
    assert paths.unmovable([tmp_path / "plain", bound], tmp_path) == bound
