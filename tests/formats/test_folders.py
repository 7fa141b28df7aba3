"""A directory of the wrong kind (a factor store, an adapter, a data build, a PEFT adapter, a model) is named by its
kind (``frod_ds.formats.folders``). The kinds are read off real outputs: the committed fixtures (with and without
ownership records) and directories made here the way each writer lays them out."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from frod_ds.formats.folders import _GOES_TO, FOLDERS, describe_folder, folder_kind, wrong_folder
from frod_ds.formats.ownership import MARKER, mark_dir
from tests.support.leftovers import REPO

FIX = REPO / "tests" / "fixtures"


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


def test_every_kind_of_folder_says_where_it_goes() -> None:
    """A kind of output added to ``KINDS`` needs its line: a folder of it given in the wrong place is named."""
    assert set(FOLDERS) == set(_GOES_TO)


def test_a_converted_gguf_model_is_a_model(tmp_path: Path) -> None:
    from frod_ds.io.model_dir import check_model_folder

    model = shutil.copytree(FIX / "run_zero3_v2" / "model", tmp_path / "converted")
    mark_dir(model, "gguf-conversion", [p.name for p in model.iterdir() if p.name != MARKER])
    assert folder_kind(model) == "gguf-conversion"
    check_model_folder(model)  # loads where a model goes
    line = wrong_folder(model, "--factor-store", ("factor-store",), "a factor store")
    assert line is not None and "is a GGUF model converted to a Hugging Face checkpoint, not a factor store" in line
