"""The sbatch scripts in launch/slurm: shell syntax, and hjd.sbatch run end to end under stand-ins for srun
and scontrol that start one process per task with the variables SLURM sets (two CPU ranks)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.helpers_ckpt import REPO, _free_port, weights, write_tiny_llama

from frod_ds.hjd.math import decompose
from frod_ds.store import FactorStore

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
    (bin_dir / "scontrol").write_text('#!/bin/bash\necho localhost\n')
    (bin_dir / "python").write_text(f'#!/bin/bash\nexec "{sys.executable}" "$@"\n')  # this interpreter, venv and all
    for f in ("srun", "scontrol", "python"):
        (bin_dir / f).chmod(0o755)
    model = write_tiny_llama(tmp_path / "model")
    out = tmp_path / "store"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", SLURM_JOB_ID="42", SLURM_JOB_NODELIST="localhost", SLURM_NTASKS="2",
               SLURM_SUBMIT_DIR=str(REPO), MASTER_PORT=str(_free_port()), MODEL=str(model), OUT=str(out),
               PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.run(["bash", str(SLURM / "hjd.sbatch"), "--device", "cpu", "--dtype", "float64",
                           "--targets", "q_proj"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
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
    (bin_dir / "scontrol").write_text('#!/bin/bash\necho localhost\n')
    (bin_dir / "scontrol").chmod(0o755)
    env.update(PATH=f"{bin_dir}:{env['PATH']}", SLURM_JOB_NODELIST="localhost", SLURM_SUBMIT_DIR=str(REPO))
    proc = subprocess.run(["bash", str(SLURM / "hjd.sbatch")], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode != 0 and "set MODEL" in proc.stderr
