"""A console stream that cannot be written (``> /dev/full``, ``2> /dev/full``: a full log disk, a scheduler's
``.err`` file on a full home) is the command's report, not its output: the real commands write their outputs
completely, equal to a plain run's, then exit 2 with one line on the other stream naming the stream that failed.
Before, HJD stopped after its manifest and training before its output_dir, both blaming "the output"'s disk, and
eval with a full stderr exited 1 with nothing written and nothing said (frod_ds/runtime/entry.py: ``_Console``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from frod_ds.formats.ownership import MARKER
from tests.support import pace
from tests.support.helpers_ckpt import write_tiny_llama
from tests.support.leftovers import REPO, clean_env
from tests.support.train_env import CPU_ZERO2, build_env

FULL = "/dev/full"
STREAMS = ("stdout", "stderr")
TRAIN = ("train", "--config", str(CPU_ZERO2), "--recipe", str(REPO / "recipes" / "demo_tiny.yaml"))


def frod(*args: str, full: tuple[str, ...], **env: str) -> subprocess.CompletedProcess:
    """``frod ARGS`` with the streams named in ``full`` on /dev/full, the others captured (text)."""
    with open(FULL, "w") as sink:
        streams = {name: sink if name in full else subprocess.PIPE for name in STREAMS}
        return subprocess.run(
            [sys.executable, "-m", "frod_ds", *args],
            cwd=REPO,
            env=clean_env(**env),
            text=True,
            timeout=pace.scaled(120),
            **streams,
        )


def the_line(proc: subprocess.CompletedProcess, full: str) -> str:
    """The one ``error:`` line of a run whose ``full`` stream was lost, from the other stream (no traceback)."""
    said = proc.stderr if full == "stdout" else proc.stdout
    errors = [line for line in said.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in said, said[-3000:]
    return errors[0]


def done_line(full: str, output: str) -> str:
    return (
        f"error: cannot write to {full} (No space left on device): {output} is complete and kept, nothing needs to "
        "run again; only what it printed there is lost"
    )


def files(root: Path, skip: tuple[str, ...] = ()) -> dict[str, bytes]:
    """Every file under ``root`` by its relative path with its bytes, but the ownership record (its stamps hold
    times) and the names in ``skip``."""
    found = {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file()}
    return {name: p.read_bytes() for name, p in found.items() if name != MARKER and name not in skip}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("console") / "model")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Model, tokenizer, a data build and a factor store (tests.support.train_env)."""
    return build_env(tmp_path_factory.mktemp("console-env"))


def _hjd(model: Path, out: Path, full: tuple[str, ...], **env: str) -> subprocess.CompletedProcess:
    return frod("hjd", "--device", "cpu", "--model", str(model), "--out", str(out), "--pi", "0.5", full=full, **env)


@pytest.fixture(scope="module")
def hjd_plain(model, tmp_path_factory) -> dict[str, bytes]:
    out = tmp_path_factory.mktemp("hjd-plain") / "store"
    proc = _hjd(model, out, ())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return files(out, skip=("manifest.json",))  # the manifest records timings


@pytest.mark.parametrize("unbuffered", ["1", ""])
@pytest.mark.parametrize("full", STREAMS)
def test_hjd_writes_its_whole_store_and_names_the_full_stream(model, hjd_plain, tmp_path, full, unbuffered):
    from frod_ds.model.store_reader import FactorStore

    out = tmp_path / "store"
    proc = _hjd(model, out, (full,), PYTHONUNBUFFERED=unbuffered)
    assert proc.returncode == 2 and the_line(proc, full) == done_line(full, f"--out {out}")
    assert files(out, skip=("manifest.json",)) == hjd_plain
    assert FactorStore.open(out).manifest.complete


def test_with_both_streams_full_the_exit_status_tells(model, hjd_plain, tmp_path):
    out = tmp_path / "store"
    proc = _hjd(model, out, STREAMS)
    assert proc.returncode == 2
    assert files(out, skip=("manifest.json",)) == hjd_plain


def test_a_failure_whose_stderr_is_full_is_said_on_stdout(tmp_path):
    """The command's own error line went to the lost stderr: stdout repeats it, naming stderr; nothing written."""
    out = tmp_path / "store"
    missing = tmp_path / "no-model"
    proc = _hjd(missing, out, ("stderr",))
    line = the_line(proc, "stderr")
    assert proc.returncode == 2 and line.startswith(
        "error: cannot write to stderr (No space left on device); the command failed (exit 2): "
    )
    assert str(missing) in line and not out.exists()


@pytest.mark.parametrize("full", STREAMS)
def test_data_build_writes_its_whole_output_and_names_the_full_stream(env, tmp_path, full):
    args = ("data", "build", "--source", str(env.root / "raw"), "--tasks", "boolq,piqa", "--out")
    plain = frod(*args, str(tmp_path / "plain"), full=())
    assert plain.returncode == 0, plain.stderr[-3000:]
    out = tmp_path / "out"
    proc = frod(*args, str(out), full=(full,))
    assert proc.returncode == 2 and the_line(proc, full) == done_line(full, f"--out {out}")
    assert files(out) == files(tmp_path / "plain")


@pytest.fixture(scope="module")
def plain_run(env, tmp_path_factory) -> Path:
    """A 2-step run with both streams captured: what a run with one stream lost must equal; export's input."""
    run = tmp_path_factory.mktemp("plain-run") / "run"
    trained = frod(*TRAIN, *_steps(env, run), full=())
    assert trained.returncode == 0, trained.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def plain_eval(env, tmp_path_factory) -> Path:
    """An eval with both streams captured: what an eval with one stream lost must equal."""
    out = tmp_path_factory.mktemp("plain-eval") / "eval"
    plain = frod(*_eval_args(env), str(out), full=())
    assert plain.returncode == 0, plain.stderr[-3000:]
    return out


def test_export_writes_its_whole_output_and_names_the_full_stdout(plain_run, tmp_path):
    """``frod export`` prints only its closing line, to stdout; with stderr full it has nothing to lose (exit 0)."""
    args = ("export", "--checkpoint", str(plain_run / "adapter-final"), "--out")
    plain = frod(*args, str(tmp_path / "plain"), full=())
    assert plain.returncode == 0, plain.stderr[-3000:]
    out = tmp_path / "out"
    proc = frod(*args, str(out), full=("stdout",))
    assert proc.returncode == 2 and the_line(proc, "stdout") == done_line("stdout", f"--out {out}")
    record = "frod_export.json"  # records the export's seconds
    assert files(out, skip=(record,)) == files(tmp_path / "plain", skip=(record,))
    records = [json.loads((d / record).read_text()) for d in (out, tmp_path / "plain")]
    untimed = [{k: v for k, v in r.items() if k != "seconds"} for r in records]
    assert untimed[0] == untimed[1]
    quiet = frod(*args, str(tmp_path / "quiet"), full=("stderr",))
    assert quiet.returncode == 0 and quiet.stdout.startswith("exported "), quiet.stdout


def _steps(env, out: Path) -> list[str]:
    return env.overrides(out, **{"train.max_steps": 2, "train.save_every": 2})


@pytest.mark.parametrize("full", STREAMS)
def test_train_writes_its_whole_run_and_names_the_full_stream(env, plain_run, tmp_path, full):
    out = tmp_path / "run"
    proc = frod(*TRAIN, *_steps(env, out), full=(full,))
    assert proc.returncode == 2 and the_line(proc, full) == done_line(full, f"output_dir {out}")
    adapter = "adapter-final/adapter.safetensors"
    assert (out / adapter).read_bytes() == (plain_run / adapter).read_bytes()
    assert sorted(files(out)) == sorted(files(plain_run))


def _eval_args(env) -> tuple[str, ...]:
    return ("eval", "--model", str(env.model), "--data", str(env.data), "--tasks", "boolq,piqa", "--output")


@pytest.mark.parametrize("full", STREAMS)
def test_eval_writes_its_whole_results_and_names_the_full_stream(env, plain_eval, tmp_path, full):
    out = tmp_path / "eval"
    proc = frod(*_eval_args(env), str(out), full=(full,))
    assert proc.returncode == 2 and the_line(proc, full) == done_line(full, f"--output {out}")
    assert files(out, skip=("results.json",)) == files(plain_eval, skip=("results.json",))
    results = [json.loads((d / "results.json").read_text())["tasks"] for d in (out, plain_eval)]
    assert results[0] == results[1]


def closed(*args: str, close: str) -> subprocess.CompletedProcess:
    """``frod ARGS`` with the stream ``close`` closed from the start (``>&-``, ``2>&-``), the other captured."""
    fd = {"stdout": 1, "stderr": 2}[close]
    return subprocess.run(
        ["bash", "-c", f'exec "$@" {fd}>&-', "frod", sys.executable, "-m", "frod_ds", *args],
        cwd=REPO,
        env=clean_env(),
        text=True,
        timeout=pace.scaled(120),
        stdout=subprocess.PIPE if close == "stderr" else None,
        stderr=subprocess.PIPE if close == "stdout" else None,
    )


@pytest.mark.parametrize("close", STREAMS)
def test_a_stream_closed_from_the_start_is_lost_as_a_full_ones_is(env, tmp_path, close):
    """``>&-`` or ``2>&-`` (a job started without one): the output whole, then exit 2 and one line on the other
    stream naming the closed one, as for a full disk; no output file takes the closed descriptor's number."""
    args = ("data", "build", "--source", str(env.root / "raw"), "--tasks", "boolq,piqa", "--out")
    plain = frod(*args, str(tmp_path / "plain"), full=())
    assert plain.returncode == 0, plain.stderr[-3000:]
    out = tmp_path / "out"
    proc = closed(*args, str(out), close=close)
    said = proc.stderr if close == "stdout" else proc.stdout
    assert proc.returncode == 2 and said.splitlines()[-1] == (
        f"error: cannot write to {close} (it was closed when the command started): --out {out} is complete and "
        "kept, nothing needs to run again; only what it printed there is lost"
    ), said[-2000:]
    assert files(out) == files(tmp_path / "plain")


def test_a_closed_stream_nothing_is_written_to_costs_nothing():
    """``frod plan --help 2>&-``: the report is whole on stdout and stderr was never needed: exit 0."""
    proc = closed("plan", "--help", close="stderr")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: frod plan"), proc.stdout[-2000:]


@pytest.mark.parametrize(
    ("env", "prefix"),
    [
        ({"RANK": "1", "WORLD_SIZE": "2"}, "[rank 1] "),
        ({"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4"}, "[rank 3] "),  # srun's tasks, as the launcher reads them
        ({"RANK": "0", "WORLD_SIZE": "1"}, ""),
        ({"RANK": "x", "WORLD_SIZE": "2"}, ""),  # no launcher's: the command names them itself
    ],
)
def test_the_lost_stream_line_carries_the_rank_the_launcher_gave(monkeypatch, capsys, env, prefix):
    from frod_ds.runtime.console import say

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    say(sys.stdout, "x")
    assert capsys.readouterr().out == f"error: {prefix}x\n"
