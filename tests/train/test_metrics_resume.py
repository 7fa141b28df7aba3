"""``metrics.jsonl`` after a kill: a last line cut short (the rank was killed mid-write) is dropped with one note
and the run resumes, logging each step once with the uninterrupted run's losses; a line edited into something
else is one error line naming it, and the file is left as it is."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.support.train_env import CPU_ZERO2, build_env, metrics, run_train

STEPS = 4


def _rows(n: int) -> list[str]:
    return [json.dumps({"step": s, "loss": 1.0 / s}) for s in range(1, n + 1)]


def test_a_torn_last_line_is_dropped_with_a_note(tmp_path, capsys):
    from frod_ds.train.metrics import drop_rows_after

    path = tmp_path / "metrics.jsonl"
    rows = _rows(3)
    path.write_text("".join(r + "\n" for r in rows) + rows[2][:11])
    drop_rows_after(path, step=2)
    assert path.read_text() == rows[0] + "\n" + rows[1] + "\n"
    notes = [x for x in capsys.readouterr().err.splitlines() if x.startswith("note:")]
    assert len(notes) == 1 and "last line was cut short" in notes[0] and str(path) in notes[0], notes


@pytest.mark.parametrize(
    "last,finished",
    [("best run so far, lr 5e-2\n", False), ("# keep\n", True), ('{"step": 3, "loss": 1.0}, mine\n', True)],
    ids=["a-note", "a-note-finished", "not-json-after-a-row"],
)
def test_a_last_line_no_kill_could_leave_is_refused(tmp_path, last, finished):
    """A row and its newline go in one write, so a kill leaves no newline after a torn row, and a row's prefix
    never holds a whole row. Any other last line that is no row is a user's: named, the file kept."""
    from frod_ds.runtime.errors import FrodError
    from frod_ds.train.metrics import drop_rows_after

    path = tmp_path / "metrics.jsonl"
    text = "".join(r + "\n" for r in _rows(3)) + last
    path.write_text(text)
    with pytest.raises(FrodError, match=r"metrics.jsonl line 4 is not a metrics row"):
        drop_rows_after(path, step=3, finished=finished)
    assert path.read_text() == text


def test_a_last_row_that_lost_only_its_newline_is_kept(tmp_path, capsys):
    """Every prefix of a JSON row but the whole row is invalid JSON: a last line that parses is complete."""
    from frod_ds.train.metrics import drop_rows_after

    path = tmp_path / "metrics.jsonl"
    rows = _rows(3)
    path.write_text("\n".join(rows))  # torn exactly before the newline
    drop_rows_after(path, step=3)
    assert path.read_text() == "".join(r + "\n" for r in rows)
    assert "note:" not in capsys.readouterr().err


def test_a_finished_runs_log_with_a_blank_line_is_left_as_it_is(tmp_path):
    from frod_ds.train.metrics import drop_rows_after

    path = tmp_path / "metrics.jsonl"
    rows = _rows(3)
    text = rows[0] + "\n\n" + rows[1] + "\n" + rows[2] + "\n"
    path.write_text(text)
    drop_rows_after(path, step=3, finished=True)
    assert path.read_text() == text


def test_a_log_with_nothing_to_drop_is_not_written_again(tmp_path):
    """A finished run's log (every row up to the step it continues from): the file is left as it is, not rewritten
    with the same rows (a re-run that then stops in one line leaves the run's folder untouched)."""
    from frod_ds.train.metrics import drop_rows_after

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(r + "\n" for r in _rows(3)))
    before = path.stat()
    drop_rows_after(path, step=3)
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


@pytest.mark.parametrize("state", ["deleted", "emptied"])
def test_a_log_that_lost_the_rows_before_the_checkpoint_says_so(tmp_path, capsys, state):
    """A resume from step 3 whose metrics.jsonl was deleted (or emptied) since: the rows of steps 1-3 cannot come
    back, and a note says the log starts after step 3 (it did silently); from step 0 there is nothing to miss."""
    from frod_ds.train.metrics import drop_rows_after

    path = tmp_path / "metrics.jsonl"
    if state == "emptied":
        path.write_text("")
    drop_rows_after(path, step=0)
    assert "note:" not in capsys.readouterr().err
    drop_rows_after(path, step=3, log_every=5)  # no row was due yet
    assert "note:" not in capsys.readouterr().err
    drop_rows_after(path, step=3, log_every=2)
    notes = [x for x in capsys.readouterr().err.splitlines() if x.startswith("note:")]
    assert len(notes) == 1 and str(path) in notes[0], notes
    assert "the rows of steps 1-3 are gone" in notes[0] and "start after step 3" in notes[0]


def test_an_edited_line_in_the_middle_is_refused_and_the_file_kept(tmp_path):
    from frod_ds.runtime.errors import FrodError
    from frod_ds.train.metrics import drop_rows_after

    path = tmp_path / "metrics.jsonl"
    rows = _rows(4)
    rows[1] = "my notes about step 2"
    text = "".join(r + "\n" for r in rows)
    path.write_text(text)
    with pytest.raises(FrodError, match=r"metrics.jsonl line 2 is not a metrics row"):
        drop_rows_after(path, step=3)
    assert path.read_text() == text


@pytest.mark.parametrize("last", ["{}", "null", "[]", '{"step": "x"}', '{"note": 1}'])
@pytest.mark.parametrize("newline", [False, True], ids=["no-newline", "newline"])
def test_a_whole_last_line_that_is_no_row_is_refused_not_dropped(tmp_path, last, newline):
    """A last line that parses is whole, so no kill tore it: one the run did not write is named, the file kept."""
    from frod_ds.runtime.errors import FrodError
    from frod_ds.train.metrics import drop_rows_after

    path = tmp_path / "metrics.jsonl"
    text = "".join(r + "\n" for r in _rows(3)) + last + ("\n" if newline else "")
    path.write_text(text)
    with pytest.raises(FrodError, match=r"metrics.jsonl line 4 is not a metrics row"):
        drop_rows_after(path, step=3, finished=True)
    assert path.read_text() == text


def test_rows_past_the_step_are_dropped_unless_the_run_is_finished(tmp_path, capsys):
    """Rows after the step a run continues from are replayed: dropped. A finished run replays nothing, so a row
    past its last step is not its own: refused, naming it, the file kept."""
    from frod_ds.runtime.errors import FrodError
    from frod_ds.train.metrics import drop_rows_after

    path = tmp_path / "metrics.jsonl"
    rows = _rows(3)
    text = "".join(r + "\n" for r in [*rows, json.dumps({"step": 7, "loss": 1.0})])
    path.write_text(text)
    with pytest.raises(FrodError, match=r"line 4 is a row of step 7, past step 3 where the finished run ended"):
        drop_rows_after(path, step=3, finished=True)
    assert path.read_text() == text
    capsys.readouterr()
    drop_rows_after(path, step=2)
    assert path.read_text() == rows[0] + "\n" + rows[1] + "\n"
    assert "note:" not in capsys.readouterr().err


@pytest.mark.slow
def test_a_run_killed_mid_row_resumes_with_each_step_logged_once(tmp_path):
    """The run left as a kill during step 4's row leaves it (its step-2 checkpoint sealed, step 3 logged, step 4's
    row half written) resumes; steps 3-4 run again and give the uninterrupted run's losses, each logged once."""
    env = build_env(tmp_path / "env")
    common = {"train.max_steps": STEPS, "train.save_every": 2, "train.keep_checkpoints": 3}
    ref = tmp_path / "ref"
    res = run_train(CPU_ZERO2, env.overrides(ref, **common), nproc=0)
    assert res.returncode == 0, res.stderr[-3000:]
    out = tmp_path / "killed"
    shutil.copytree(ref, out)
    shutil.rmtree(out / "checkpoints" / "step00000004")
    shutil.rmtree(out / "adapter-final")
    (out / "checkpoints" / "latest_complete").write_text("step00000002")
    lines = (ref / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("".join(x + "\n" for x in lines[:3]) + lines[3][: len(lines[3]) // 2])
    res = run_train(CPU_ZERO2, env.overrides(out, **common), nproc=0)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    assert sum("last line was cut short" in x for x in res.stderr.splitlines() if x.startswith("note:")) == 1
    want, got = metrics(ref), metrics(out)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in got] == [r["loss"] for r in want]


def test_metrics_rows_are_what_the_loop_writes(tmp_path):
    """The reader's idea of a row is the writer's: ``MetricsLog`` rows survive ``drop_rows_after`` whole."""
    from frod_ds.train.metrics import MetricsLog, drop_rows_after

    log = MetricsLog(Path(tmp_path), tensorboard=False)
    for s in range(1, 4):
        log.write({"step": s, "loss": float("nan") if s == 2 else 0.5})
    before = (tmp_path / "metrics.jsonl").read_text()
    drop_rows_after(tmp_path / "metrics.jsonl", step=3)
    assert (tmp_path / "metrics.jsonl").read_text() == before


def test_a_run_folder_moved_away_while_training_is_one_line_naming_it(tmp_path):
    """The run's folder renamed while it trains (a tidy-up, a cleanup script): the next row cannot be appended;
    one line says the folder is gone and where the run stopped, not a FileNotFoundError traceback. A metrics file
    removed from a folder that is still there is written again, as before."""
    from frod_ds.runtime.errors import FrodError
    from frod_ds.train.metrics import MetricsLog

    run = tmp_path / "run"
    run.mkdir()
    log = MetricsLog(run, tensorboard=False)
    log.write({"step": 1, "loss": 1.0})
    (run / "metrics.jsonl").unlink()
    log.write({"step": 2, "loss": 1.0})
    assert (run / "metrics.jsonl").read_text().count("\n") == 1
    run.rename(tmp_path / "moved")
    with pytest.raises(FrodError, match=r"output_dir .*run is gone \(moved or deleted while training\).*at step 3"):
        log.write({"step": 3, "loss": 1.0})
    assert not run.exists()
