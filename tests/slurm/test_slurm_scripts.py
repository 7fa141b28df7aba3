"""The scripts in launch/slurm without a Slurm: shell syntax, hjd.sbatch end to end under stand-ins for srun and
scontrol that start one process per task with the variables SLURM sets (two CPU ranks), and submit.sh /
pipeline.sh under a stand-in sbatch. tests/slurm/test_slurm_multinode.py runs them under a real Slurm."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from frod_ds.hjd.math import decompose
from frod_ds.model.store_reader import FactorStore
from tests.support import pace
from tests.support.helpers_ckpt import REPO, weights, write_tiny_llama
from tests.support.leftovers import clean_env, free_port

SLURM = REPO / "launch" / "slurm"

FAKE_SRUN = """#!/bin/bash
# stand-in for srun on one node: drop srun's options, start the command once per task
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
  SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_STEP_NUM_TASKS=$SLURM_NTASKS SLURM_STEP_NODELIST=$SLURM_JOB_NODELIST "$@" &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
exit $rc
"""


@pytest.mark.parametrize("script", sorted(p.name for p in SLURM.iterdir()))
def test_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(SLURM / script)], capture_output=True).returncode == 0


def test_scripts_name_only_existing_flags():
    from launch.eval import parse_args as eval_args
    from launch.hjd import parse_args as hjd_args

    hjd_args(["--model", "m", "--out", "o"])
    eval_args(["--checkpoint", "c", "--data", "d", "--tasks", "all", "--output", "o"])
    text = (SLURM / "train.sbatch").read_text()
    assert 'launch/train.py --config "$DS_CONFIG" --recipe "$RECIPE"' in text


def test_hjd_sbatch_runs_two_tasks(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho localhost\n")
    for f in ("srun", "scontrol"):
        (bin_dir / f).chmod(0o755)
    model = write_tiny_llama(tmp_path / "model")
    out = tmp_path / "store"
    env = clean_env()
    env.update(
        PATH=f"{bin_dir}:{env['PATH']}",
        SLURM_JOB_ID="42",
        SLURM_JOB_NODELIST="localhost",
        SLURM_NTASKS="2",
        SLURM_SUBMIT_DIR=str(REPO),
        MASTER_PORT=str(free_port()),
        MODEL=str(model),
        OUT=str(out),
        PYTHON=sys.executable,
    )
    proc = subprocess.run(
        ["bash", str(SLURM / "hjd.sbatch"), "--device", "cpu", "--dtype", "float64", "--targets", "q_proj"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=pace.scaled(300),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "rendezvous localhost:" in proc.stdout
    store = FactorStore.open(out)
    assert store.manifest.world_size == 2
    members = store.categories["q_proj"]
    Ws = [w.double() for w in weights(model, members)]
    ref = decompose(Ws, pi=store.pi, dtype=torch.float64)
    V = store.load_V("q_proj", torch.float64)
    assert (torch.linalg.norm(V - ref.V) / torch.linalg.norm(ref.V)).item() < 1e-6


def test_hjd_sbatch_without_model_says_what_to_set(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL", "OUT")}
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho localhost\n")
    (bin_dir / "scontrol").chmod(0o755)
    env.update(
        PATH=f"{bin_dir}:{env['PATH']}",
        SLURM_JOB_NODELIST="localhost",
        SLURM_SUBMIT_DIR=str(REPO),
        PYTHON=sys.executable,
    )
    proc = subprocess.run(["bash", str(SLURM / "hjd.sbatch")], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode != 0 and "set MODEL" in proc.stderr


def _home_without_python_on_path(tmp_path: Path, venv: bool) -> tuple[Path, dict[str, str]]:
    """A checkout (links to this one's code) whose node has a ``python`` on PATH that is not the project's: it
    fails the way a node without one does. With ``venv``, the checkout has ``.venv/bin/python`` (this
    interpreter)."""
    home = tmp_path / "home"
    home.mkdir()
    for part in ("launch", "frod_ds", "recipes", "ds_configs"):
        (home / part).symlink_to(REPO / part)
    if venv:
        (home / ".venv" / "bin").mkdir(parents=True)
        (home / ".venv" / "bin" / "python").write_text(f'#!/bin/bash\nexec "{sys.executable}" "$@"\n')
        (home / ".venv" / "bin" / "python").chmod(0o755)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho localhost\n")
    (bin_dir / "python").write_text('#!/bin/bash\necho "python: not found" >&2\nexit 127\n')
    for f in ("srun", "scontrol", "python"):
        (bin_dir / f).chmod(0o755)
    env = clean_env()
    env.pop("PYTHON", None)
    env.update(
        PATH=f"{bin_dir}:/usr/bin:/bin",
        SLURM_JOB_ID="42",
        SLURM_JOB_NODELIST="localhost",
        SLURM_NTASKS="1",
        FROD_DS_HOME=str(home),
        MASTER_PORT=str(free_port()),
        MODEL="m",
        OUT=str(tmp_path / "store"),
    )
    return home, env


def test_sbatch_scripts_run_the_checkouts_venv_python_not_a_bare_python(tmp_path):
    home, env = _home_without_python_on_path(tmp_path, venv=True)
    proc = subprocess.run(
        ["bash", str(SLURM / "hjd.sbatch"), "--help"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=pace.scaled(120),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"python {home}/.venv/bin/python," in proc.stdout and "usage:" in proc.stdout, proc.stdout


@pytest.mark.parametrize("python", ["/nonexistent/python", "python"])
def test_sbatch_scripts_refuse_an_interpreter_that_cannot_run_the_project(tmp_path, python):
    _, env = _home_without_python_on_path(tmp_path, venv=False)
    proc = subprocess.run(
        ["bash", str(SLURM / "train.sbatch")],
        env=dict(env, PYTHON=python, RECIPE="r"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=pace.scaled(120),
    )
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("error: ") and python in proc.stderr and "set PYTHON" in proc.stderr, proc.stderr


# srun's report after a step ended with 143, as a real 2 x 2 job printed it (tests/slurm/test_slurm_multinode.py)
PREEMPTED = ["n1: tasks 0-1: Exited with exit code 143", "n2: tasks 2-3: Exited with exit code 143"]
STOPPED_STARTING = ["n2: tasks 2-3: Terminated", "n1: tasks 0-1: Terminated"]  # SIGTERM before the handler
KILLED_WORKER = [
    "n2: task 2: Killed",
    "n1: task 1: Terminated",
    "n1: task 0: Exited with exit code 1",
    "n2: task 3: Exited with exit code 1",
]


@pytest.mark.parametrize(
    "report,requeued",
    [(PREEMPTED, True), (STOPPED_STARTING, True), (KILLED_WORKER, False)],
    ids=["preempted", "stopped-starting", "killed-worker"],
)
def test_train_sbatch_requeues_a_sigterm_stop_but_not_a_failed_task(tmp_path, report, requeued):
    """srun exits 143 in all three cases (after a failed task --kill-on-bad-exit ends the others with SIGTERM);
    only a stop on SIGTERM may requeue: a crash requeued would crash again, forever."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    lines = "".join(f"echo 'srun: error: {line}' >&2\n" for line in report)
    (bin_dir / "srun").write_text(f"#!/bin/bash\necho 'training output'\n{lines}exit 143\n")
    (bin_dir / "scontrol").write_text(
        '#!/bin/bash\nif [ "$1" = requeue ]; then echo "$2" >> "$REQUEUED"; else echo localhost; fi\n'
    )
    for f in ("srun", "scontrol"):
        (bin_dir / f).chmod(0o755)
    env = clean_env()
    env.update(
        PATH=f"{bin_dir}:{env['PATH']}",
        SLURM_JOB_ID="42",
        SLURM_JOB_NODELIST="localhost",
        SLURM_NTASKS="4",
        SLURM_SUBMIT_DIR=str(REPO),
        MASTER_PORT="20042",
        PYTHON=sys.executable,
        RECIPE="recipes/demo_tiny.yaml",
        DEVICE="cpu",
        REQUEUED=str(tmp_path / "requeued"),
        TMPDIR=str(tmp_path),
    )
    proc = subprocess.run(
        ["bash", str(SLURM / "train.sbatch")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=pace.scaled(120),
    )
    assert proc.returncode == 143, proc.stdout + proc.stderr
    assert "training output" in proc.stdout and all(line in proc.stderr for line in report), proc.stdout + proc.stderr
    assert (tmp_path / "requeued").exists() == requeued, proc.stdout + proc.stderr
    assert ("requeueing it to resume" in proc.stdout) == requeued and ("a task failed" in proc.stderr) != requeued
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("frod-train-")] == []  # its report file removed


# ---- submit.sh and pipeline.sh under a stand-in sbatch that records its arguments ---------------------

FAKE_SBATCH = """#!/bin/bash
# stand-in for sbatch --parsable: one line per call (arguments, then DEVICE/MODEL/OUT/CHECKPOINT/OUTPUT as the
# job would see them), job ids 101, 102, ...; FAIL_AT=n makes the n-th call fail like a rejected job.
n=$(( $(cat "$CALLS" 2>/dev/null | wc -l) + 1 ))
echo "$* | DEVICE=${DEVICE:-} MODEL=${MODEL:-} OUT=${OUT:-} CHECKPOINT=${CHECKPOINT:-} OUTPUT=${OUTPUT:-}" >> "$CALLS"
if [ "$n" = "${FAIL_AT:-0}" ]; then echo "sbatch: error: Invalid generic resource (gres) specification" >&2; exit 1; fi
echo "$((100 + n));cluster"
"""


def _fake_slurm_env(tmp_path: Path, **extra) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "sbatch").write_text(FAKE_SBATCH)
    (bin_dir / "scancel").write_text('#!/bin/bash\necho "$*" >> "$CANCELLED"\n')
    for f in ("sbatch", "scancel"):
        (bin_dir / f).chmod(0o755)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "SBATCH_"))
        and k
        not in ("DEVICE", "NODES", "GPUS_PER_NODE", "TASKS_PER_NODE", "CPUS_PER_TASK", "PARTITION", "TIME", "LOG_DIR")
    }
    env.update(
        PATH=f"{bin_dir}:{env['PATH']}",
        CALLS=str(tmp_path / "calls"),
        CANCELLED=str(tmp_path / "cancelled"),
        LOG_DIR=str(tmp_path / "fresh" / "logs"),
        **extra,
    )
    return env


def _calls(tmp_path: Path) -> list[str]:
    return (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []


def test_submit_creates_the_log_folder_and_maps_the_shape_onto_sbatch(tmp_path):
    env = _fake_slurm_env(
        tmp_path,
        GPUS_PER_NODE="0",
        TASKS_PER_NODE="2",
        CPUS_PER_TASK="1",
        NODES="1",
        PARTITION="cpu",
        TIME="00:10:00",
        MODEL="m",
        OUT="o",
    )
    proc = subprocess.run(
        [str(SLURM / "submit.sh"), "--qos=low", str(SLURM / "hjd.sbatch"), "--dtype", "float64"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and proc.stdout == "101\n", proc.stderr
    assert (tmp_path / "fresh" / "logs").is_dir()
    args, seen = _calls(tmp_path)[0].split(" | ")
    log_dir = tmp_path / "fresh" / "logs"
    assert args == (
        f"--parsable --nodes=1 --gpus-per-node=0 --ntasks-per-node=2 --cpus-per-task=1 --partition cpu "
        f"--time 00:10:00 --output {log_dir}/%x-%j.out --qos=low {SLURM / 'hjd.sbatch'} --dtype float64"
    )
    assert seen.startswith("DEVICE=cpu MODEL=m OUT=o")


def test_submit_without_shape_keeps_the_scripts_own_lines(tmp_path):
    proc = subprocess.run(
        [str(SLURM / "submit.sh"), str(SLURM / "eval.sbatch")],
        env=_fake_slurm_env(tmp_path),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    args, seen = _calls(tmp_path)[0].split(" | ")
    assert args == f"--parsable --output {tmp_path}/fresh/logs/%x-%j.out {SLURM / 'eval.sbatch'}"
    assert seen.startswith("DEVICE= ")


def test_submit_refuses_a_shape_that_is_not_a_number(tmp_path):
    env = _fake_slurm_env(tmp_path, GPUS_PER_NODE="eight")
    proc = subprocess.run(
        [str(SLURM / "submit.sh"), str(SLURM / "hjd.sbatch")], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 2 and proc.stderr == "error: GPUS_PER_NODE must be a whole number, got 'eight'\n"
    assert _calls(tmp_path) == [] and not (tmp_path / "fresh").exists()


def _pipeline(tmp_path: Path, **extra) -> subprocess.CompletedProcess:
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    (data / "train.jsonl").write_text("")
    env = _fake_slurm_env(
        tmp_path,
        MODEL="/m",
        STORE="/s",
        DATA=str(data),
        RUN="/r",
        RECIPE="recipes/demo_tiny.yaml",
        HJD_ARGS="--targets q_proj",
        EVAL_ARGS="--limit 5",
        **extra,
    )
    return subprocess.run([str(SLURM / "pipeline.sh"), "train.max_steps=3"], env=env, capture_output=True, text=True)


def test_pipeline_chains_the_three_jobs_with_afterok(tmp_path):
    proc = _pipeline(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "hjd 101\ntrain 102\neval 103\n"
    hjd, train, evaluation = [c.split(" | ") for c in _calls(tmp_path)]
    assert hjd[0].endswith(f"{SLURM / 'hjd.sbatch'} --targets q_proj") and "MODEL=/m OUT=/s" in hjd[1]
    assert (
        f"--dependency=afterok:101 {SLURM / 'train.sbatch'} model.base=/m model.factor_store=/s "
        f"data.train={tmp_path / 'data'}/train.jsonl output_dir=/r train.max_steps=3" in train[0]
    )
    assert f"--dependency=afterok:102 {SLURM / 'eval.sbatch'} --limit 5" in evaluation[0]
    assert "CHECKPOINT=/r/adapter-final OUTPUT=/r/eval" in evaluation[1]


def test_pipeline_cancels_what_it_submitted_when_a_later_submission_fails(tmp_path):
    proc = _pipeline(tmp_path, FAIL_AT="3")
    assert proc.returncode != 0 and proc.stdout == ""
    assert (tmp_path / "cancelled").read_text() == "101 102\n"
    assert "error: submission failed; cancelled jobs 101 102" in proc.stderr
