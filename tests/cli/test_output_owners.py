"""Who owns an output, command by command: a second writer of an output a live process writes is refused at once
(exit 2, one ``error:`` line naming the holder's pid and host) with nothing written, ``train.new_run=true`` included
while the run it would move aside is still training; a dead writer's lease is taken over with a ``note:``; an
``--overwrite`` or an eval re-run over files frod-ds did not write is refused, naming them, with nothing deleted.
Holders are real second processes: a running ``frod train``, or a process holding the lease as a writer would."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from frod_ds.formats.lease import lease_path
from launch import demo as demo_cli
from launch import eval as eval_cli
from launch import export as export_cli
from launch import hjd as hjd_cli
from launch import train as train_cli
from tests.support import pace
from tests.support.leftovers import clean_env
from tests.support.train_env import CPU_ZERO2, REPO, build_env, run_train, train_cmd

HOLD = """
import sys, time
from frod_ds.formats.lease import acquire
lease = acquire(sys.argv[1], sys.argv[2])
print("held", flush=True)
time.sleep(120)
"""


def tree(path: Path) -> dict[str, str]:
    """Every file under ``path`` (relative name → sha256): proof that nothing changed."""
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


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return build_env(tmp_path_factory.mktemp("owners"))


@pytest.fixture(scope="module")
def adapter(env):
    out = env.root / "run"
    overrides = env.overrides(out, **{"train.max_steps": 2, "train.save_every": 0})
    proc = run_train(CPU_ZERO2, overrides, nproc=0)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "adapter-final"


def holding_process(out: Path, kind: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out), kind],
        cwd=REPO,
        env={**clean_env(), "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


COMMANDS = {  # command → (the kind its lease names, how to run it in-process writing to OUT)
    "hjd": ("factor-store", lambda env, adapter, out: hjd_cli.main(["--model", str(env.model), "--out", str(out)])),
    "eval": (
        "eval-results",
        lambda env, adapter, out: eval_cli.main(
            ["--checkpoint", str(adapter), "--data", str(env.data), "--tasks", "boolq", "--limit", "2"]
            + ["--output", str(out)]
        ),
    ),
    "data build": (
        "data-build",
        lambda env, adapter, out: _data_main(["build", "--source", str(env.root / "raw"), "--out", str(out)]),
    ),
    "export hf": (
        "hf-export",
        lambda env, adapter, out: export_cli.main(["--checkpoint", str(adapter), "--out", str(out)]),
    ),
    "export peft": (
        "peft-export",
        lambda env, adapter, out: export_cli.main(
            ["--checkpoint", str(adapter), "--format", "peft", "--out", str(out)]
        ),
    ),
    "train": (
        "training-run",
        lambda env, adapter, out: train_cli.main(["--config", str(CPU_ZERO2), *env.overrides(out)]),
    ),
    "demo": ("demo", lambda env, adapter, out: demo_cli.main(["--out", str(out)])),
}


def _data_main(argv: list[str]) -> int:
    from frod_ds.prep.command import main

    return main(argv)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_second_writer_is_refused_at_once_naming_the_holder(env, adapter, tmp_path, capsys, command):
    kind, run = COMMANDS[command]
    out = tmp_path / "out"
    proc = holding_process(out, kind)
    try:
        before = tree(tmp_path)
        line = one_error(capsys, run(env, adapter, out))
        assert "is being written by" in line and f"pid {proc.pid} on host {socket.gethostname()}" in line, line
        assert tree(tmp_path) == before and not out.exists()
    finally:
        proc.kill()
        proc.wait()


def test_a_dead_writers_lease_is_taken_over_with_a_note(env, tmp_path, capsys):
    out = tmp_path / "data"
    proc = holding_process(out, "data-build")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _data_main(["build", "--source", str(env.root / "raw"), "--tasks", "boolq,piqa", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"note: --out {out}: taking over the lease of frod data build (pid {proc.pid}" in err
    assert (out / "train.jsonl").is_file() and not lease_path(out).exists()


def test_new_run_while_the_run_is_still_training_is_refused_and_the_run_keeps_its_files(env, tmp_path, capsys):
    """The run keeps training; ``train.new_run=true`` into its output_dir is refused naming it (nothing moved
    aside); stopped by SIGTERM, the run still writes its last checkpoint (what new_run once lost)."""
    out, log = tmp_path / "run", tmp_path / "first.log"
    overrides = env.overrides(out, **{"train.max_steps": 100000, "train.save_every": 0})
    with open(log, "wb") as f:
        first = subprocess.Popen(
            train_cmd(CPU_ZERO2, overrides, nproc=0), cwd=REPO, env=clean_env(), stdout=f, stderr=f
        )
    try:
        t0 = time.time()
        while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text().strip():
            assert first.poll() is None and time.time() - t0 < pace.scaled(90), log.read_text()[-3000:]
            time.sleep(0.1)
        line = one_error(capsys, train_cli.main(["--config", str(CPU_ZERO2), *overrides, "train.new_run=true"]))
        assert f"output_dir {out} is being written by frod train (pid {first.pid} on host" in line, line
        assert not [p for p in out.iterdir() if p.name.startswith("superseded-")]
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=pace.scaled(90)) == 143, log.read_text()[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert (out / "checkpoints" / "latest_complete").is_file() and not lease_path(out).exists()
    assert "training-run" == json.loads((out / ".frod-ds-output").read_text())["kind"]


def test_export_overwrite_over_files_frod_ds_did_not_write_is_refused_naming_them(adapter, tmp_path, capsys):
    out = tmp_path / "merged"
    assert export_cli.main(["--checkpoint", str(adapter), "--out", str(out)]) == 0
    (out / "my_notes.md").write_text("mine")
    (out / "eval").mkdir()
    (out / "eval" / "results.json").write_text("{}")
    before = tree(tmp_path)
    line = one_error(capsys, export_cli.main(["--checkpoint", str(adapter), "--out", str(out), "--overwrite"]))
    assert "my_notes.md" in line and "eval/" in line and "config.json" not in line
    assert tree(tmp_path) == before


def test_hjd_overwrite_over_a_foreign_file_is_refused_and_deletes_nothing(env, tmp_path, capsys):
    out = tmp_path / "store"
    assert hjd_cli.main(["--model", str(env.model), "--out", str(out), "--categories", "q_proj"]) == 0
    (out / "q_proj.notes.safetensors").write_text("mine")
    before = tree(tmp_path)
    line = one_error(capsys, hjd_cli.main(["--model", str(env.model), "--out", str(out), "--overwrite"]))
    assert "q_proj.notes.safetensors" in line and "manifest.json" not in line
    assert tree(tmp_path) == before
    (out / "q_proj.notes.safetensors").unlink()
    assert hjd_cli.main(["--model", str(env.model), "--out", str(out), "--overwrite"]) == 0


def test_hjd_overwrite_of_a_store_file_the_user_replaced_is_refused_and_the_store_kept(env, tmp_path, capsys):
    """A store is written in place (no stamps): its manifest's checksums tell the user's bytes from frod-ds'."""
    out = tmp_path / "store"
    assert hjd_cli.main(["--model", str(env.model), "--out", str(out)]) == 0
    reference = (out / "k_proj.V.safetensors").read_bytes()
    (out / "q_proj.V.safetensors").write_text("mine")
    before = tree(tmp_path)
    line = one_error(capsys, hjd_cli.main(["--model", str(env.model), "--out", str(out), "--overwrite"]))
    assert "q_proj.V.safetensors" in line and "k_proj" not in line and "changed since" in line
    assert tree(tmp_path) == before
    # a damaged file, as the store's reader says: deleted, the same command rebuilds its category
    (out / "q_proj.V.safetensors").unlink()
    assert hjd_cli.main(["--model", str(env.model), "--out", str(out)]) == 0
    assert (out / "k_proj.V.safetensors").read_bytes() == reference
    assert hjd_cli.main(["--model", str(env.model), "--verify", str(out)]) == 0
    assert hjd_cli.main(["--model", str(env.model), "--out", str(out), "--overwrite"]) == 0


@pytest.mark.parametrize("marked", [True, False], ids=["earlier eval", "unmarked eval output from before records"])
def test_eval_into_earlier_results_holding_other_files_is_refused(env, adapter, tmp_path, capsys, marked):
    out = tmp_path / "ev"
    argv = ["--checkpoint", str(adapter), "--data", str(env.data), "--tasks", "boolq", "--limit", "2"]
    if marked:
        assert eval_cli.main([*argv, "--output", str(out)]) == 0
        capsys.readouterr()
    else:  # what every eval wrote before outputs held records
        out.mkdir()
        (out / "results.json").write_text(json.dumps({"mode": "loglik", "config": {}, "tasks": {}}))
        (out / "results.md").write_text("| task |\n")
        (out / "predictions.jsonl").write_text("")
    (out / "plot.png").write_bytes(b"mine")
    before = tree(tmp_path)
    line = one_error(capsys, eval_cli.main([*argv, "--output", str(out)]))
    assert "plot.png" in line and "results.json" not in line
    assert tree(tmp_path) == before
    (out / "plot.png").unlink()
    assert eval_cli.main([*argv, "--output", str(out)]) == 0
    assert sorted(json.loads((out / ".frod-ds-output").read_text())["files"]) == [
        "predictions.jsonl",
        "results.json",
        "results.md",
    ]
    assert os.path.getsize(out / "predictions.jsonl") > 0
