"""The trainer in parts: the names that moved out of ``frod_ds.train.trainer`` still import from there for one
release, as the very objects of their new modules, with a ``DeprecationWarning`` naming the new home."""

from __future__ import annotations

import importlib
import warnings

import pytest

from frod_ds.train import trainer


@pytest.mark.parametrize("name", sorted(trainer._MOVED_NAMES))
def test_a_name_moved_out_of_the_trainer_warns_and_is_the_same_object(name):
    home = importlib.import_module(trainer._MOVED_NAMES[name])
    assert name in home.__all__
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert getattr(trainer, name) is getattr(home, name)
    assert [w.category for w in seen] == [DeprecationWarning]
    assert home.__name__ in str(seen[0].message) and "0.3.0" in str(seen[0].message)


def test_the_trainer_still_exports_its_entry_points_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from frod_ds.train.trainer import Run, check_run_dir, enable_gradient_checkpointing, fit, setup
    assert Run.__module__ == "frod_ds.train.loop" and fit.__module__ == "frod_ds.train.loop"
    assert callable(setup) and callable(enable_gradient_checkpointing) and callable(check_run_dir)
    with pytest.raises(AttributeError, match="no attribute"):
        trainer.no_such_name_here


@pytest.mark.parametrize("entry", ["checkpoints", "metrics.jsonl", "loss.png"])
def test_an_output_dir_entry_of_the_wrong_kind_is_refused_before_the_run(tmp_path, entry):
    """Round 15: a run whose checkpoints/ was a file restarted from step 0 over the finished run's metrics and died
    in DeepSpeed's save (FileExistsError); metrics.jsonl as a folder was an IsADirectoryError. Both are refused
    first, named, with nothing written."""
    from frod_ds.formats.ownership import record_files
    from frod_ds.runtime.errors import FrodError
    from frod_ds.train.run_dir import RUN_FILES, RUN_KIND, check_run_dir

    out = tmp_path / "run"
    out.mkdir()
    record_files(out, RUN_FILES, RUN_KIND)  # a run's folder, as training opens it
    if entry == "checkpoints":
        (out / entry).write_text("x")
    else:
        (out / entry).mkdir()
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(FrodError, match=f"{out / entry} is (not a folder|a folder), where the run keeps its {entry}"):
        check_run_dir(out)
    assert sorted(p.name for p in out.iterdir()) == before
    (out / entry).unlink() if entry == "checkpoints" else (out / entry).rmdir()
    (out / "checkpoints").mkdir()
    check_run_dir(out)  # the kinds the run writes
