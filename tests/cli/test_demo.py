"""``frod demo`` (what ``make demo`` runs) end to end on CPU ranks: every stage writes inside the demo's output
under its lease, training into a folder apart from its inputs (a demo again over its own output:
tests/formats/test_ownership.py). The recipe is the shipped one cut to a few steps; the accuracies it prints are
checked against eval's own files."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from tests.support import pace
from tests.support.leftovers import REPO, clean_env

pytestmark = pytest.mark.slow


def test_the_demo_runs_every_stage(tmp_path):
    """On one rank: the stages on two (HJD and eval under both launchers, ZeRO-3 training by decoder layer) are
    tests/cli/test_cli.py's, tests/eval/test_eval_cli.py's and tests/train's; two here took about 70 CPU-seconds, near
    the test's limit on a busy 2-core machine."""
    recipe = yaml.safe_load((REPO / "recipes" / "demo_tiny.yaml").read_text())
    recipe["train"].update(max_steps=4, save_every=2, rotation_every=2)
    short = tmp_path / "short.yaml"
    short.write_text(yaml.safe_dump(recipe))
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "frod_ds", "demo", "--out", str(out), "--recipe", str(short), "--ranks", "1"]
    # about 50 CPU-seconds in nine interpreters: its hang guard is within the test's 120 s limit
    run = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=pace.scaled(110))
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-2000:])
    results = {name: json.loads((out / name / "results.json").read_text())["tasks"] for name in ("eval_base", "eval")}
    for task in ("boolq", "piqa"):
        said = re.search(rf"{task}: held-out accuracy ([\d.]+) \(base model ([\d.]+)", run.stdout)
        assert said, run.stdout[-2000:]
        assert float(said.group(1)) == pytest.approx(results["eval"][task]["accuracy"], abs=5e-4)
        assert float(said.group(2)) == pytest.approx(results["eval_base"][task]["accuracy"], abs=5e-4)
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert (out / "run" / "adapter-final" / "adapter_config.json").is_file()
    assert not (out / "adapter-final").exists()  # the run's folder holds no input of it
    # a finished demo stamps every file in it: what the same demo again does first (remove_owned) refuses a user's
    # edit of one written in place (the refusal's line: tests/formats/test_ownership.py)
    from frod_ds.formats.ownership import remove_owned
    from frod_ds.runtime.errors import FrodError

    metrics = out / "run" / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + "mine\n")
    with pytest.raises(FrodError, match="changed since frod-ds wrote them: run/metrics.jsonl"):
        remove_owned(out, "demo")
    assert metrics.read_text().endswith("mine\n")


STAGE_BODY = """
import sys
from pathlib import Path
from frod_ds.cli.demo import _run
from frod_ds.runtime.entry import run_script
d = Path(sys.argv[1])
run_script(lambda: _run(["sh", "-c", f"sleep 300 & echo $! > {d}/pid; wait"], "a stage", d / "log"))
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL", "SIGHUP", "SIGQUIT", "SIGKILL to its group"])
def test_a_stopped_demo_stops_its_stages_ranks_too(tmp_path, sig):
    """SIGTERM to the demo while a stage runs: the stage's whole process group goes with it (100 HJD ranks of a
    demo stopped by a time limit ran on as orphans); SIGKILL, SIGHUP and SIGQUIT too, which end the demo without
    its handlers, and a SIGKILL of the demo's whole process group (its guard, in a session of its own, lives on)."""
    import signal
    import time

    def default_signals():  # as a shell gives them: a run under nohup (or a CI runner) may ignore SIGHUP
        for s in (signal.SIGHUP, signal.SIGQUIT):
            signal.signal(s, signal.SIG_DFL)

    proc = subprocess.Popen(
        [sys.executable, "-c", STAGE_BODY, str(tmp_path)],
        cwd=REPO,
        env=clean_env(),
        start_new_session=True,
        preexec_fn=default_signals,
    )
    t0 = time.monotonic()
    while not (tmp_path / "pid").is_file() or not (tmp_path / "pid").read_text().strip():
        assert proc.poll() is None and time.monotonic() - t0 < 60
        time.sleep(0.05)
    grandchild = int((tmp_path / "pid").read_text())
    if sig == "SIGKILL to its group":
        os.killpg(proc.pid, signal.SIGKILL)
    else:
        proc.send_signal(getattr(signal, sig))
    want = 143 if sig == "SIGTERM" else -getattr(signal, sig.split()[0])
    assert proc.wait(timeout=60) == want
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10:
        try:
            with open(f"/proc/{grandchild}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):  # dead, not yet reaped by its new parent
                    return
        except (FileNotFoundError, ProcessLookupError):
            return
        time.sleep(0.1)
    raise AssertionError(f"the stage's process {grandchild} outlived the demo")


def test_a_stage_does_not_inherit_an_outer_launchers_variables(tmp_path, monkeypatch):
    """``torchrun … frod demo``: rank 0 runs the demo, and each stage it launches starts its own ranks; with the outer
    agent's variables (``TORCHELASTIC_USE_AGENT_STORE`` above all) they joined a store nobody hosted for them and
    waited out the join. A stage starts without them, everything else of the environment kept."""
    from frod_ds.cli import demo

    outer = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2",
             "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
             "GROUP_RANK": "0", "ROLE_RANK": "0", "FROD_TEST_KEPT": "1"}  # fmt: skip
    for k, v in outer.items():
        monkeypatch.setenv(k, v)
    log = tmp_path / "stage.log"
    demo._run([sys.executable, "-c", "import os, json; print(json.dumps(sorted(os.environ)))"], "env", log)
    seen = set(json.loads(log.read_text().splitlines()[-1]))
    assert "FROD_TEST_KEPT" in seen and "PATH" in seen
    assert not seen & (set(outer) - {"FROD_TEST_KEPT"}), seen & set(outer)
