"""A path given on the command line is named for what it is (``frod_ds.runtime.paths``): a symbolic-link loop, a
broken link or a named pipe is not "not found", and a directory of the wrong kind (a factor store, an adapter, a data
build, a PEFT adapter, a model) is named by its kind. The kinds are read off real outputs: the committed fixtures
(marked and unmarked) and directories made here the way each writer lays them out."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from frod_ds.runtime.atomic import MARKER
from frod_ds.runtime.paths import describe_folder, dir_problem, file_problem, folder_kind, wrong_folder
from tests.support.leftovers import REPO

FIX = REPO / "tests" / "fixtures"


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


@pytest.mark.parametrize(
    "where, kind",
    [
        ("format_v1/store", "factor-store"),  # unmarked (written before markers): by its manifest
        ("format_v1/adapter", "adapter"),
        ("format_v1/model", "hf-checkpoint"),
        ("run_zero3_v2/factors", "factor-store"),  # marked
        ("run_zero3_v2/data", "data-build"),
        ("run_zero3_v2/run", "training-run"),
        ("run_zero3_v2/model", "hf-checkpoint"),
    ],
)
def test_folder_kind_of_the_committed_outputs(where: str, kind: str) -> None:
    assert folder_kind(FIX / where) == kind


def test_folder_kind_without_markers_reads_the_files(tmp_path: Path) -> None:
    data = shutil.copytree(FIX / "run_zero3_v2" / "data", tmp_path / "data")
    (data / MARKER).unlink()
    assert folder_kind(data) == "data-build"
    run = shutil.copytree(FIX / "run_zero3_v2" / "run", tmp_path / "run")
    (run / MARKER).unlink()
    assert folder_kind(run) == "training-run"
    peft = tmp_path / "peft"
    peft.mkdir()
    (peft / "adapter_config.json").write_text(json.dumps({"peft_type": "FROD", "r": 8}))
    (peft / "adapter_model.safetensors").write_bytes(b"")
    assert folder_kind(peft) == "peft-adapter"
    (tmp_path / "empty").mkdir()
    assert folder_kind(tmp_path / "empty") is None and describe_folder(tmp_path / "empty") == "an empty directory"
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "x.txt").write_text("x")
    assert describe_folder(tmp_path / "notes") == "a directory holding no model or frod-ds output"


def test_wrong_folder_says_what_it_is_and_where_it_goes() -> None:
    store = FIX / "run_zero3_v2" / "factors"
    line = wrong_folder(store, "--model", ("hf-checkpoint",), "a model checkpoint")
    assert line == (
        f"--model {store} is a factor store, not a model checkpoint; a factor store goes to --factor-store or "
        "model.factor_store"
    )
    assert wrong_folder(store, "--factor-store", ("factor-store",), "a factor store") is None
    assert "its adapter-final/ goes to --checkpoint" in wrong_folder(
        FIX / "run_zero3_v2" / "run", "--checkpoint", ("adapter",), "an adapter"
    )
    assert wrong_folder(FIX / "run_zero3_v2" / "model", "--data", ("data-build",), "a data build").startswith(
        f"--data {FIX / 'run_zero3_v2' / 'model'} is a Hugging Face model checkpoint, not a data build"
    )


@pytest.mark.parametrize("name, says", [("pipe", "named pipe"), ("loop_a", "symbolic-link loop")])
def test_readers_of_data_models_and_stores_name_a_pipe_or_a_link_loop(odd: Path, name: str, says: str) -> None:
    """Each reader that used to answer "not found" (or try the Hub) for a named pipe or a link loop names it."""
    from frod_ds.eval.run import load_task_rows
    from frod_ds.io.hf_checkpoint import resolve_model_dir
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
