"""launch/slurm under a real single-node Slurm (Debian's slurm-wlm and munge, installed here if missing):
pipeline.sh submits hjd → train → eval with afterok dependencies on the tiny model (CPU, gloo, 2 tasks each),
training is preempted with SIGTERM, and every result is checked against a run outside Slurm or an
uninterrupted one. One Slurm start-up serves the whole module; the daemons stop at its end.

Skips, saying why, only where Slurm cannot be installed (not root, no apt-get); with CI=true a failing
apt-get is a failure, not a skip.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tests.support.slurm_local import LocalSlurm, SlurmUnavailable, install
from tests.support.leftovers import clean_env
from tests.support.train_env import REPO, metrics

pytestmark = pytest.mark.slow

SLURM = REPO / "launch" / "slurm"
STEPS = 24  # training steps of every run here; SIGTERM comes at step >= 2
CPU_SHAPE = {"GPUS_PER_NODE": "0", "TASKS_PER_NODE": "2", "CPUS_PER_TASK": "1", "NODES": "1"}
TRAIN_OVERRIDES = [
    "model.sparsity=0.1", "data.cutoff_len=64", "train.micro_batch_size=4", "train.grad_accum=2",
    "train.lr_sigma=1e-2", "train.lr_s=1e-3", "train.log_every=1", "train.rotation_every=0", "train.save_every=0",
    "train.warmup_ratio=0.25", "train.schedule=cosine", f"train.max_steps={STEPS}",
]
TASKS = "boolq,piqa"


@pytest.fixture(scope="module")
def slurm():
    t0 = time.time()
    try:
        install_s = install()
    except SlurmUnavailable as e:
        if e.tried_apt and os.environ.get("CI") == "true":
            pytest.fail(f"CI: could not install Slurm: {e}")
        pytest.skip(f"no local Slurm: {e}")
    root = Path(tempfile.mkdtemp(prefix="frod-slurm-"))  # not under pytest's 0700 tmp: munged must reach it
    cluster = LocalSlurm.start(root)
    print(f"\nlocal Slurm: install {install_s:.1f} s, start-up {cluster.started_in_s:.1f} s", flush=True)
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
        print(f"\nlocal Slurm: {time.time() - t0:.1f} s from install to stop", flush=True)


@dataclass
class Tiny:
    root: Path
    model: Path
    data: Path
    env: dict[str, str]  # what a user's shell would hold when submitting: the venv's python first on PATH


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tiny:
    """Tiny Llama, its tokenizer and data_prep output (no factor store: the HJD job builds it)."""
    from transformers import AutoTokenizer

    from frod_ds.toy import train_sentencepiece_tokenizer, write_synthetic_tasks, write_tiny_llama

    root = tmp_path_factory.mktemp("slurm_tiny")
    env = {k: v for k, v in clean_env().items() if not k.startswith(("DS_", "CUDA_"))}
    env.update(PATH=f"{Path(sys.executable).parent}:{env['PATH']}")
    write_synthetic_tasks(root / "raw", n_train=48, n_eval=16, seed=0)
    subprocess.run([sys.executable, "-m", "data_prep", "build", "--source", str(root / "raw"), "--tasks", TASKS,
                    "--out", str(root / "data")], check=True, cwd=REPO, env=dict(env, PYTHONPATH=str(REPO)),
                   capture_output=True)
    texts = [json.loads(line)["prompt"] + "\nAnswer: " + json.loads(line)["answer"]
             for line in (root / "data" / "train.jsonl").read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(str(train_sentencepiece_tokenizer(root / "tokenizer", texts, vocab_size=400)))
    write_tiny_llama(root / "model", vocab_size=len(tok), seed=0, max_shard_size="60KB", hidden_size=32,
                     intermediate_size=48, num_attention_heads=4, num_key_value_heads=2)
    tok.save_pretrained(str(root / "model"))
    return Tiny(root, root / "model", root / "data", env)


def _wait_for_step(slurm: LocalSlurm, job_id: str, out: Path, step: int, timeout: float = 900) -> None:
    t0 = time.time()
    rows = out / "metrics.jsonl"
    while not rows.exists() or rows.read_text().count("\n") < step:
        job = slurm.job(job_id)
        ok = job.state in ("PENDING", "RUNNING", "CONFIGURING") and job.fields.get("Reason") != "DependencyNeverSatisfied"
        assert ok, f"job {job_id} {job.state} ({job.fields.get('Reason')}) before step {step}\n{_all_logs(out.parent)}"
        assert time.time() - t0 < timeout, f"job {job_id}: no step {step} after {timeout} s\n{slurm.logs()}"
        time.sleep(0.1)


def _all_logs(root: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((root / "logs").glob("*.out")))


def _preempt(slurm: LocalSlurm, job_id: str, out: Path) -> None:
    """SIGTERM to the job's tasks (not the batch shell): what --signal=TERM@N and preemption deliver."""
    _wait_for_step(slurm, job_id, out, 2)
    res = slurm.run(["scancel", "--signal=TERM", job_id])
    assert res.returncode == 0, res.stderr


def _log(tiny: Tiny, name: str, job_id: str) -> str:
    return (tiny.root / "logs" / f"{name}-{job_id}.out").read_text()


def _submit_train(slurm: LocalSlurm, tiny: Tiny, store: Path, out: Path, **env) -> str:
    res = slurm.run([str(SLURM / "submit.sh"), str(SLURM / "train.sbatch"), f"model.base={tiny.model}",
                     f"model.factor_store={store}", f"data.train={tiny.data / 'train.jsonl'}", f"output_dir={out}",
                     *TRAIN_OVERRIDES], env={**tiny.env, **CPU_SHAPE, "LOG_DIR": str(tiny.root / "logs"),
                                             "RECIPE": "recipes/demo_tiny.yaml", **env})
    assert res.returncode == 0 and res.stdout.strip().isdigit(), res.stdout + res.stderr
    return res.stdout.strip()


def _assert_same_adapter(a_dir: Path, b_dir: Path) -> None:
    a = load_file(str(a_dir / "adapter.safetensors"))
    b = load_file(str(b_dir / "adapter.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs from the uninterrupted run's"


@pytest.fixture(scope="module")
def pipeline(slurm, tiny):
    """pipeline.sh on the tiny model, its training job preempted at step >= 2 (it requeues itself)."""
    run, store, logs = tiny.root / "run", tiny.root / "store", tiny.root / "logs"
    assert not logs.exists()  # the pipeline creates the log folder before Slurm opens the output files
    env = {**tiny.env, **CPU_SHAPE, "MODEL": str(tiny.model), "STORE": str(store),
           "DATA": str(tiny.data), "RUN": str(run), "RECIPE": "recipes/demo_tiny.yaml", "TASKS": TASKS,
           "LOG_DIR": str(logs), "EVAL_ARGS": "--batch-size 4"}
    t0 = time.time()
    res = slurm.run([str(SLURM / "pipeline.sh"), *TRAIN_OVERRIDES], env=env, cwd=tiny.root)
    assert res.returncode == 0, res.stdout + res.stderr
    ids = dict(line.split() for line in res.stdout.splitlines())
    assert list(ids) == ["hjd", "train", "eval"], res.stdout
    deps = {stage: slurm.job(i).fields.get("Dependency", "") for stage, i in ids.items()}
    _preempt(slurm, ids["train"], run)
    jobs = {stage: slurm.wait(i, timeout=900) for stage, i in ids.items()}
    print(f"\npipeline with one preemption: {time.time() - t0:.1f} s", flush=True)
    return {"ids": ids, "deps": deps, "jobs": jobs, "run": run, "store": store}


def test_pipeline_chains_hjd_train_eval_with_afterok(pipeline, tiny):
    ids, jobs = pipeline["ids"], pipeline["jobs"]
    assert pipeline["deps"]["train"].startswith(f"afterok:{ids['hjd']}"), pipeline["deps"]
    assert pipeline["deps"]["eval"].startswith(f"afterok:{ids['train']}"), pipeline["deps"]
    for stage, job in jobs.items():
        assert (job.state, job.exit_code) == ("COMPLETED", "0:0"), (stage, job, _log(tiny, f"frod-{stage}", job.id))
    hjd_log = _log(tiny, "frod-hjd", ids["hjd"])
    assert "2 tasks on" in hjd_log and "device cpu" in hjd_log, hjd_log
    start = {stage: job.fields["StartTime"] for stage, job in jobs.items()}
    end = {stage: job.fields["EndTime"] for stage, job in jobs.items()}
    assert end["hjd"] <= start["train"] and end["train"] <= start["eval"], (start, end)


def test_hjd_job_equals_single_process_decomposition(pipeline, tiny):
    """Each member reconstructed from the 2-task store, and V against single-process ``decompose`` where V is
    unique (more stacked rows than columns, several members; elsewhere the projectors onto V's leading and
    completion columns, as in test_distributed_hjd)."""
    from frod_ds.hjd import decompose
    from frod_ds.store import FactorStore
    from tests.support.helpers_ckpt import weights

    def rel(a, b):
        return (torch.linalg.norm(a - b) / torch.linalg.norm(b)).item()

    store = FactorStore.open(pipeline["store"])
    assert store.manifest.world_size == 2 and store.complete and len(store.categories) == 6
    for category, members in store.categories.items():
        Ws = [w.double() for w in weights(tiny.model, members)]
        ref = decompose(Ws, pi=store.pi, dtype=torch.float64)
        V = store.load_V(category, torch.float64)
        M, n = sum(w.shape[0] for w in Ws), V.shape[0]
        k, unique = min(M, n), M > n and len(Ws) > 1
        if unique:
            assert rel(V, ref.V) < 1e-5, category
        else:
            assert rel(V[:, :k] @ V[:, :k].T, ref.V[:, :k] @ ref.V[:, :k].T) < 1e-5, category
        for member, W in zip(members, Ws):
            U, sigma = store.load_U(member, torch.float64), store.load_sigma(member, torch.float64)
            assert rel((U * sigma) @ V.T, W) < 1e-5, member


def test_eval_job_equals_single_process_eval(pipeline, tiny, tmp_path):
    from launch.eval import main as eval_main

    ref = tmp_path / "eval_ref"
    assert eval_main(["--checkpoint", str(pipeline["run"] / "adapter-final"), "--data", str(tiny.data),
                      "--tasks", TASKS, "--output", str(ref), "--batch-size", "4"]) == 0
    got = json.loads((pipeline["run"] / "eval" / "results.json").read_text())
    want = json.loads((ref / "results.json").read_text())
    assert sorted(got["tasks"]) == sorted(TASKS.split(","))
    for task in want["tasks"]:
        assert got["tasks"][task]["n"] == want["tasks"][task]["n"] == 16
        assert got["tasks"][task]["accuracy"] == pytest.approx(want["tasks"][task]["accuracy"], abs=1e-12)
    assert (pipeline["run"] / "eval" / "predictions.jsonl").read_text() == (ref / "predictions.jsonl").read_text()


@pytest.fixture(scope="module")
def uninterrupted(slurm, tiny, pipeline):
    """train.sbatch once more, never interrupted, on the factor store the pipeline built."""
    out = tiny.root / "uninterrupted"
    job = slurm.wait(_submit_train(slurm, tiny, pipeline["store"], out), timeout=900)
    assert (job.state, job.restarts) == ("COMPLETED", 0), job
    return out


def test_preempted_pipeline_training_requeues_and_equals_uninterrupted(pipeline, uninterrupted, tiny):
    train = pipeline["jobs"]["train"]
    log = _log(tiny, "frod-train", train.id)
    assert train.restarts == 1, log
    assert "requeueing it to resume" in log and "resumed from step" in log, log
    assert [r["step"] for r in metrics(pipeline["run"])] == list(range(1, STEPS + 1))
    _assert_same_adapter(uninterrupted / "adapter-final", pipeline["run"] / "adapter-final")


def test_sigterm_then_resubmit_equals_uninterrupted(slurm, tiny, pipeline, uninterrupted):
    """REQUEUE=0: the job fails with 143 after its checkpoint; submitting the same command again resumes."""
    out = tiny.root / "resubmitted"
    first = _submit_train(slurm, tiny, pipeline["store"], out, REQUEUE="0")
    _preempt(slurm, first, out)
    job = slurm.wait(first)
    assert (job.state, job.exit_code, job.restarts) == ("FAILED", "143:0", 0), (job, _log(tiny, "frod-train", first))
    tag = (out / "checkpoints" / "latest_complete").read_text()
    assert 2 <= int(tag.removeprefix("step")) < STEPS and not (out / "adapter-final").exists()
    second = slurm.wait(_submit_train(slurm, tiny, pipeline["store"], out, REQUEUE="0"), timeout=900)
    assert (second.state, second.exit_code) == ("COMPLETED", "0:0"), second
    assert f"resumed from {tag}" in _log(tiny, "frod-train", second.id)
    _assert_same_adapter(uninterrupted / "adapter-final", out / "adapter-final")


def test_pipeline_with_the_gpu_defaults_is_refused_on_a_gpu_less_cluster(slurm, tiny, pipeline):
    """Without GPUS_PER_NODE=0 the scripts ask for 8 GPUs: sbatch refuses, pipeline.sh exits non-zero and
    leaves nothing queued."""
    env = {**tiny.env, "MODEL": str(tiny.model), "STORE": str(tiny.root / "s2"), "DATA": str(tiny.data),
           "RUN": str(tiny.root / "r2"), "RECIPE": "recipes/demo_tiny.yaml", "LOG_DIR": str(tiny.root / "logs")}
    res = slurm.run([str(SLURM / "pipeline.sh")], env=env)
    assert res.returncode != 0 and "gres" in res.stderr.lower(), res.stdout + res.stderr
    assert slurm.run(["squeue", "-h"]).stdout.strip() == ""


@pytest.mark.parametrize("unset", ["MODEL", "RECIPE"])
def test_pipeline_without_an_input_says_what_to_set(slurm, tiny, unset):
    env = {**tiny.env, "MODEL": str(tiny.model), "STORE": "s", "DATA": str(tiny.data), "RUN": "r",
           "RECIPE": "recipes/demo_tiny.yaml"}
    env.pop(unset)
    res = slurm.run([str(SLURM / "pipeline.sh")], env=env)
    assert res.returncode == 2 and res.stderr.strip() == res.stderr.strip().splitlines()[0], res.stderr
    assert res.stderr.startswith(f"error: set {unset}"), res.stderr
    assert slurm.run(["squeue", "-h"]).stdout.strip() == ""
