"""The trainer in parts: the names that moved out of ``frod_ds.train.trainer`` still import from there for one
release, as the very objects of their new modules, with a ``DeprecationWarning`` naming the new home."""

from __future__ import annotations

import importlib
import json
import os
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


@pytest.mark.parametrize("entry", ["loss.png", "metrics.jsonl", "recipe.yaml"])
@pytest.mark.parametrize("planted", ["symlink", "hardlink", "fifo"])
def test_a_run_files_temporary_that_is_no_leftover_is_refused_before_the_run(tmp_path, entry, planted):
    """A link, a second name of another file or a pipe at a run file's temporary (``<name>.frod-tmp``) would be written
    through by the save that replaces the file: refused before the run, the planted thing and its target unchanged;
    a leftover of a killed write (a plain file) is the run's own."""
    from frod_ds.formats.ownership import record_files
    from frod_ds.runtime.errors import FrodError
    from frod_ds.train.run_dir import RUN_FILES, RUN_KIND, check_run_dir

    out = tmp_path / "run"
    out.mkdir()
    record_files(out, RUN_FILES, RUN_KIND)
    decoy, tmp = tmp_path / "decoy", out / f"{entry}.frod-tmp"
    decoy.write_bytes(b"a user's file")
    if planted == "symlink":
        tmp.symlink_to(decoy)
    elif planted == "hardlink":
        os.link(decoy, tmp)
    else:
        os.mkfifo(tmp)
    with pytest.raises(FrodError, match=rf"{tmp} is in the way of writing {entry}"):
        check_run_dir(out)
    assert decoy.read_bytes() == b"a user's file" and os.path.lexists(tmp)
    tmp.unlink()
    tmp.write_bytes(b"half a write")  # a killed write's leftover
    check_run_dir(out)


def test_the_loss_plot_is_written_through_the_projects_temporary(tmp_path):
    """plot_loss writes loss.png via loss.png.frod-tmp (created exclusively, never through a link); a link there is
    refused and its target left as it was."""
    from frod_ds.runtime.errors import FrodError
    from frod_ds.train.metrics import plot_loss

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": i, "loss": 2.0 / i}) + "\n" for i in range(1, 5)))
    png = tmp_path / "loss.png"
    plot_loss(metrics, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and sorted(p.name for p in tmp_path.iterdir()) == [
        "loss.png",
        "metrics.jsonl",
    ]
    decoy = tmp_path / "decoy.png"
    decoy.write_bytes(b"a user's picture")
    (tmp_path / "loss.png.frod-tmp").symlink_to(decoy)
    with pytest.raises(FrodError, match="loss.png.frod-tmp is in the way of writing loss.png"):
        plot_loss(metrics, png)
    assert decoy.read_bytes() == b"a user's picture"


def test_the_loss_plot_replaces_only_a_plot_a_run_wrote(tmp_path, capsys):
    """A run's own loss.png is replaced by the next plot; a file a user put there (their own picture, or a PNG
    another tool made) is left byte for byte, with a note."""
    from frod_ds.runtime.errors import forget_notes
    from frod_ds.train.metrics import plot_loss

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": i, "loss": 2.0 / i}) + "\n" for i in range(1, 5)))
    png = tmp_path / "loss.png"
    plot_loss(metrics, png)
    first = png.read_bytes()
    metrics.write_text(metrics.read_text() + json.dumps({"step": 5, "loss": 0.1}) + "\n")
    plot_loss(metrics, png)
    assert png.read_bytes() != first  # the run's own plot, replaced
    for theirs in (b"mine", first.replace(b"frod-ds loss plot", b"someone else ok")):
        png.write_bytes(theirs)
        forget_notes()  # a note is said once per command
        plot_loss(metrics, png)
        assert png.read_bytes() == theirs
        assert f"note: {png} is not a loss plot a run wrote: left as it is" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["latest", "zero_to_fp32.py", "latest_complete"])
def test_a_checkpoint_root_file_with_a_second_name_is_detached_before_a_save(tmp_path, name):
    """DeepSpeed rewrites ``latest`` and its recovery scripts in place at every save: where one is a second name of
    another file (a hard link: a ``cp -al`` backup, or a user's file), this folder's name is dropped before the save,
    so the save writes a file of its own and the other name keeps its content. ``latest_complete`` is replaced by a
    rename, so it stays. A symbolic link is still refused (its target is what a save would write)."""
    from frod_ds.runtime.errors import FrodError
    from frod_ds.train.checkpoints import check_root_files, detach_root_files

    root = tmp_path / "checkpoints"
    root.mkdir()
    decoy = tmp_path / "decoy"
    decoy.write_text("a user's file")
    os.link(decoy, root / name)
    check_root_files(root)
    detach_root_files(root)
    assert decoy.read_text() == "a user's file" and os.path.lexists(root / name) == (name == "latest_complete")
    (root / name).unlink(missing_ok=True)
    (root / name).symlink_to(decoy)
    with pytest.raises(FrodError, match=rf"{root / name} is a symbolic link to {decoy}"):
        check_root_files(root)


def test_a_resume_writes_the_adapter_a_stop_left_unwritten(monkeypatch, tmp_path):
    """A due save seals its checkpoint, then publishes ``adapter-<step>``; a kill between the two left a checkpoint
    without its adapter, and the resume from it never wrote that adapter. Now the resume writes it (once, and only
    for a step inside the run: step 0 has none, the last step's is adapter-final)."""
    import types

    import torch

    from frod_ds.train import loop

    calls = []
    monkeypatch.setattr(loop, "train_step", lambda run, step: {"loss": 1.0, "grad_norm": 1.0})
    monkeypatch.setattr(loop.dist, "all_reduce_sum", lambda t: torch.zeros_like(t))
    monkeypatch.setattr(loop.dist, "on_main", lambda fn: fn())
    monkeypatch.setattr(loop, "save_checkpoint", lambda run, step: calls.append(("checkpoint", step)))
    monkeypatch.setattr(loop, "save_adapter", lambda run, step, name: calls.append(("adapter", name)))
    train = types.SimpleNamespace(save_every=2, eval_every=0, rotation_every=0, log_every=1, max_nonfinite_steps=3)
    run = types.SimpleNamespace(recipe=types.SimpleNamespace(train=train), total_steps=10, inputs=None, out=tmp_path)
    bar = types.SimpleNamespace(update=lambda n: None, set_postfix=lambda **k: None, close=lambda: None)
    assert loop._step(run, loop.LoopState(step=1), None, bar) is False
    assert calls == [("checkpoint", 2), ("adapter", "adapter-2")]  # sealed first: never an adapter of no checkpoint
    calls.clear()
    loop._publish_resumed_adapter(run, 4)  # resumed from step 4, its adapter never published
    assert calls == [("adapter", "adapter-4")]
    calls.clear()
    (tmp_path / "adapter-4").mkdir()
    for step in (4, 0, 10):  # published; nothing at step 0; the last step's adapter is adapter-final
        loop._publish_resumed_adapter(run, step)
    assert calls == []


def test_a_recorded_recipe_with_an_integer_python_cannot_read_is_another_recipe(tmp_path):
    """A run folder's recipe.yaml edited to hold a 5000-digit integer is no record of this recipe (it is written
    again), not a ValueError out of the integer's conversion."""
    from frod_ds.config.recipe import Recipe
    from frod_ds.train.run_dir import _same_recipe

    path = tmp_path / "recipe.yaml"
    path.write_text("train:\n  max_steps: " + "9" * 5000 + "\n")
    assert _same_recipe(path, Recipe()) is False
