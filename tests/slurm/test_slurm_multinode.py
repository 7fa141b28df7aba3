"""launch/slurm on a real multi-node Slurm (tests/support/slurm_cluster.py: three slurmds, each in its own namespaces on
a private bridge; gloo on CPU, one CPU per rank slot). One cluster serves every test here.

- pipeline.sh on 2 nodes x 1 rank, its training preempted (SIGTERM -> checkpoint -> requeue -> resume), against
  the same three stages run uninterrupted on one node with the same world size (2 ranks started here, with the
  sbatch scripts' commands): factor store, adapter and eval bitwise equal; HJD and eval within the tolerances of
  the single-process checks;
- a node failing mid-training (every process on the first node, the rendezvous and batch host, killed):
  requeued and resumed from the last sealed checkpoint on the nodes left, a spare among them (hosts and
  MASTER_ADDR change); the adapter bitwise equal to the uninterrupted one. A job of its own holds the port the
  training job's id would have given it on its first node, so it must pick another;
- a killed worker (2 nodes x 2 ranks: several tasks per node) ends the job on every node within 60 s; a path that
  exists on one node only fails the job within 60 s with a one-line error naming it;
- a SIGTERM stop without requeue (REQUEUE=0) resumes bitwise when the same command is submitted again; the
  pipeline's afterok chain; pipeline.sh's own errors (GPU defaults on a GPU-less cluster, a missing input).

Each job is as small as what it shows allows (two ranks, 8 steps): a rank's start (its imports) is most of a job's
time on 2 cores.

Skips, with the reason, only where namespaces or Slurm cannot be had; in CI (``CI=true``) that is a failure,
and .ci/run checks that these tests ran.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support import pace
from tests.support.leftovers import clean_env
from tests.support.slurm_cluster import SlurmCluster, available
from tests.support.slurm_local import SlurmUnavailable
from tests.support.train_env import REPO, metrics

pytestmark = pytest.mark.slow

SLURM = REPO / "launch" / "slurm"
STEPS = 8  # SIGTERM at step >= 2; the node failure after the checkpoint of step 3
TRAIN_OVERRIDES = [
    "model.sparsity=0.1",
    "data.cutoff_len=64",
    "train.micro_batch_size=4",
    "train.grad_accum=2",
    "train.lr_sigma=1e-2",
    "train.lr_s=1e-3",
    "train.log_every=1",
    "train.rotation_every=0",
    "train.save_every=0",
    "train.warmup_ratio=0.25",
    "train.schedule=cosine",
    f"train.max_steps={STEPS}",
]
TASKS = "boolq,piqa"
TWO_BY_TWO = {"GPUS_PER_NODE": "0", "NODES": "2", "TASKS_PER_NODE": "2", "CPUS_PER_TASK": "1"}
TWO_BY_ONE = {"GPUS_PER_NODE": "0", "NODES": "2", "TASKS_PER_NODE": "1", "CPUS_PER_TASK": "1"}


def _in_ci() -> bool:
    return os.environ.get("CI") == "true"


@pytest.fixture(scope="session")
def cluster():
    """Three nodes with 4 CPUs each: two for a job, and a spare to move it to or run another job beside it."""
    try:
        reason = available()
    except SlurmUnavailable as e:
        reason = str(e)
    if reason:
        if _in_ci():
            pytest.fail(f"CI: no multi-node Slurm here: {reason}")
        pytest.skip(f"no multi-node Slurm: {reason}")
    root = Path(tempfile.mkdtemp(prefix="frod-mn-"))  # not under pytest's 0700 tmp: munged must reach it
    t0 = time.time()
    c = SlurmCluster.start(root, nodes=3, cpus=4)
    print(f"\nmulti-node Slurm up in {c.started_in_s:.1f} s", flush=True)
    try:
        yield c
    finally:
        c.stop()
        shutil.rmtree(root, ignore_errors=True)
        print(f"\nmulti-node Slurm: {time.time() - t0:.1f} s from start to stop", flush=True)


@dataclass
class Tiny:
    root: Path
    model: Path
    data: Path
    env: dict[str, str]  # a user's shell when submitting


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Tiny Llama, its tokenizer and data_prep output, on the filesystem every node shares."""
    from transformers import AutoTokenizer

    from frod_ds.testing.toy import train_sentencepiece_tokenizer, write_synthetic_tasks, write_tiny_llama

    root = tmp_path_factory.mktemp("slurm_multinode")
    env = {k: v for k, v in clean_env().items() if not k.startswith(("DS_", "CUDA_"))}
    # PYTHON names the interpreter (the documented way); training builds no DeepSpeed op on CPU (init_deepspeed),
    # so the jobs need no shared extension cache
    env = {**env, "PYTHON": sys.executable, "LOG_DIR": str(root / "logs"), "RECIPE": "recipes/demo_tiny.yaml"}
    write_synthetic_tasks(root / "raw", n_train=48, n_eval=16, seed=0)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "data_prep",
            "build",
            "--source",
            str(root / "raw"),
            "--tasks",
            TASKS,
            "--out",
            str(root / "data"),
        ],
        check=True,
        cwd=REPO,
        env=env,
        capture_output=True,
    )
    texts = [
        json.loads(line)["prompt"] + "\nAnswer: " + json.loads(line)["answer"]
        for line in (root / "data" / "train.jsonl").read_text().splitlines()
    ]
    tok = AutoTokenizer.from_pretrained(str(train_sentencepiece_tokenizer(root / "tokenizer", texts, vocab_size=400)))
    write_tiny_llama(
        root / "model",
        vocab_size=len(tok),
        seed=0,
        max_shard_size="60KB",
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    tok.save_pretrained(str(root / "model"))
    yield Tiny(root, root / "model", root / "data", env)


# ---- helpers ----------------------------------------------------------------------------------------------


def _hostnames(cluster, nodelist: str) -> list[str]:
    """The node names of a Slurm node list (``n[1-2]`` -> n1, n2), as Slurm expands it."""
    return cluster.run(["scontrol", "show", "hostnames", nodelist]).stdout.split()


def _log(tiny: Tiny, name: str, job_id: str) -> str:
    path = tiny.root / "logs" / f"{name}-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def _all_logs(tiny: Tiny) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted((tiny.root / "logs").glob("*.out"))
    )


def _steps_done(out: Path) -> int:
    rows = out / "metrics.jsonl"
    return (
        max((json.loads(line)["step"] for line in rows.read_text().splitlines() if line.strip()), default=0)
        if rows.exists()
        else 0
    )


def _wait_for_step(cluster: SlurmCluster, tiny: Tiny, job_id: str, out: Path, step: int, timeout: float = 600) -> None:
    t0 = time.time()
    while _steps_done(out) < step:
        job = cluster.job(job_id)
        ok = (
            job.state in ("PENDING", "RUNNING", "CONFIGURING", "REQUEUED")
            and job.fields.get("Reason") != "DependencyNeverSatisfied"
        )
        assert ok, f"job {job_id} {job.state} ({job.fields.get('Reason')}) before step {step}\n{_all_logs(tiny)}"
        assert time.time() - t0 < pace.scaled(timeout), f"job {job_id}: no step {step}\n{cluster.logs()}"
        time.sleep(0.1)


def _submit_train(
    cluster: SlurmCluster,
    tiny: Tiny,
    store: Path,
    out: Path,
    shape: dict[str, str],
    *extra: str,
    sbatch: tuple[str, ...] = (),
    data: Path | None = None,
    **env,
) -> str:
    data_file = data if data is not None else tiny.data / "train.jsonl"
    res = cluster.run(
        [
            str(SLURM / "submit.sh"),
            *sbatch,
            str(SLURM / "train.sbatch"),
            f"model.base={tiny.model}",
            f"model.factor_store={store}",
            f"data.train={data_file}",
            f"output_dir={out}",
            *TRAIN_OVERRIDES,
            *extra,
        ],
        env={**tiny.env, **shape, **env},
    )
    assert res.returncode == 0 and res.stdout.strip().isdigit(), res.stdout + res.stderr
    return res.stdout.strip()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tree_digest(root: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    return {str(p.relative_to(root)): _sha256(p) for p in sorted(root.rglob("*")) if p.is_file() and p.name not in skip}


def _assert_same_adapter(a_dir: Path, b_dir: Path) -> None:
    a, b = load_file(str(a_dir / "adapter.safetensors")), load_file(str(b_dir / "adapter.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"
    assert _sha256(a_dir / "adapter.safetensors") == _sha256(b_dir / "adapter.safetensors")


def _task_pids(cluster: SlurmCluster, node: str, script: str = "launch/train.py") -> list[int]:
    pids = []
    for pid in cluster.node_pids(node):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if script.encode() in cmd:
            pids.append(pid)
    return pids


# ---- pipeline.sh: 2 nodes x 1 rank (preempted) against one node, 2 ranks ---------------------------------------


@pytest.fixture(scope="module")
def pipeline(cluster, tiny):
    """pipeline.sh on 2 nodes x 1 rank; its training gets SIGTERM at step >= 2 and requeues itself (onto whichever
    two nodes are free then)."""
    base = tiny.root / "2x1"
    env = {
        **tiny.env,
        **TWO_BY_ONE,
        "MODEL": str(tiny.model),
        "STORE": str(base / "store"),
        "DATA": str(tiny.data),
        "RUN": str(base / "run"),
        "TASKS": TASKS,
        "EVAL_ARGS": "--batch-size 4",
    }
    res = cluster.run([str(SLURM / "pipeline.sh"), *TRAIN_OVERRIDES], env=env, cwd=tiny.root)
    assert res.returncode == 0, res.stdout + res.stderr
    ids = dict(line.split() for line in res.stdout.splitlines())
    assert list(ids) == ["hjd", "train", "eval"], res.stdout
    deps = {stage: cluster.job(i).fields.get("Dependency", "") for stage, i in ids.items()}
    t0 = time.time()
    _wait_for_step(cluster, tiny, ids["train"], base / "run", 2)
    assert cluster.run(["scancel", "--signal=TERM", ids["train"]]).returncode == 0  # what --signal=TERM@N delivers
    jobs = {stage: cluster.wait(i, timeout=600) for stage, i in ids.items()}
    print(f"\npipeline: {time.time() - t0:.1f} s after the first training step", flush=True)
    return {"ids": ids, "store": base / "store", "run": base / "run", "deps": deps, "jobs": jobs}


@pytest.fixture(scope="module")
def single(tiny):
    """The pipeline's three stages uninterrupted on one node with its world size: 2 ranks forked here
    (tests/support/ranks.py), each stage the command its sbatch script runs, in the environment a CPU job has."""
    from tests.support import ranks

    base = tiny.root / "single"
    store, run = base / "store", base / "run"
    env = {**tiny.env, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}  # what DEVICE=cpu exports
    stages = {
        "hjd": ["launch/hjd.py", "--model", str(tiny.model), "--out", str(store), "--device", "cpu"],
        "train": [
            "launch/train.py",
            "--config",
            "ds_configs/zero3_cpu_fp32.json",
            "--recipe",
            tiny.env["RECIPE"],
            "model.dtype=float32",
            f"model.base={tiny.model}",
            f"model.factor_store={store}",
            f"data.train={tiny.data / 'train.jsonl'}",
            f"output_dir={run}",
            *TRAIN_OVERRIDES,
        ],
        "eval": [
            "launch/eval.py",
            "--checkpoint",
            str(run / "adapter-final"),
            "--data",
            str(tiny.data),
            "--tasks",
            TASKS,
            "--output",
            str(run / "eval"),
            "--batch-size",
            "4",
        ],
    }
    for stage, cmd in stages.items():
        res = ranks.run(2, cmd, env, REPO, timeout=300)
        assert res.returncode == 0, (stage, res.stdout[-2000:] + res.stderr[-3000:])
    return {"store": store, "run": run}


def test_pipeline_runs_on_two_nodes_and_resumes_after_preemption(cluster, pipeline, tiny):
    r = pipeline
    for stage, job in r["jobs"].items():
        assert (job.state, job.exit_code) == ("COMPLETED", "0:0"), (stage, job, _log(tiny, f"frod-{stage}", job.id))
        assert len(_hostnames(cluster, job.fields["NodeList"])) == 2 and job.fields["NumTasks"] == "2", (
            stage,
            job.fields,
        )
    train_log = _log(tiny, "frod-train", r["ids"]["train"])
    assert r["jobs"]["train"].restarts == 1, train_log
    # each start (the first, and the requeued one: Slurm places it on whichever two nodes are free then) runs 2
    # tasks on two nodes and meets on the first of them
    marker = f"job {r['ids']['train']}: "
    starts = [
        line[line.index(marker) :] for line in train_log.splitlines() if marker in line and " rendezvous " in line
    ]
    assert len(starts) == 2, train_log
    for start in starts:
        placed = re.search(r"2 tasks on (\S+), .* rendezvous ([^:]+):", start)
        assert placed, start
        nodes = _hostnames(cluster, placed.group(1))
        assert len(nodes) == 2 and placed.group(2) == nodes[0], start
    assert "requeueing it to resume" in train_log and "resumed from step" in train_log, train_log
    assert [row["step"] for row in metrics(r["run"])] == list(range(1, STEPS + 1))
    ids, jobs = r["ids"], r["jobs"]  # chained with afterok: each stage starts after the previous one succeeded
    assert r["deps"]["train"].startswith(f"afterok:{ids['hjd']}") and r["deps"]["eval"].startswith(
        f"afterok:{ids['train']}"
    ), r["deps"]
    start = {stage: job.fields["StartTime"] for stage, job in jobs.items()}
    end = {stage: job.fields["EndTime"] for stage, job in jobs.items()}
    assert end["hjd"] <= start["train"] and end["train"] <= start["eval"], (start, end)
    assert "device cpu" in _log(tiny, "frod-hjd", ids["hjd"])


def _manifest_without_timings(store: Path) -> dict:
    manifest = json.loads((store / "manifest.json").read_text())
    manifest.pop("run")  # wall times and per-rank host memory of the run that built it
    for record in manifest["categories"].values():
        record.pop("seconds"), record.pop("phase_seconds")
    return manifest


def test_two_nodes_equal_one_node_with_the_same_world_size_bitwise(pipeline, single):
    """Same world size, so the same arithmetic, whichever nodes the ranks run on and however often the training
    was stopped: every factor file and the adapter byte for byte, the store's manifest apart from its timings (its
    checksums and errors included), the eval predictions byte for byte and its scores exactly (results.json also
    names its own paths)."""
    two, one = pipeline, single
    bookkeeping = ("manifest.json", ".frod-ds-output")  # timings; a complete store's stamps hold mtimes
    factors = _tree_digest(two["store"], skip=bookkeeping)
    assert len(factors) > 2 and factors == _tree_digest(one["store"], skip=bookkeeping)
    assert _manifest_without_timings(two["store"]) == _manifest_without_timings(one["store"])
    _assert_same_adapter(two["run"] / "adapter-final", one["run"] / "adapter-final")
    two_eval, one_eval = two["run"] / "eval", one["run"] / "eval"
    assert _sha256(two_eval / "predictions.jsonl") == _sha256(one_eval / "predictions.jsonl")
    scores = [json.loads((d / "results.json").read_text())["tasks"] for d in (two_eval, one_eval)]
    assert scores[0] == scores[1] and sorted(scores[0]) == sorted(TASKS.split(","))


def test_two_node_hjd_and_eval_equal_single_process(pipeline, tiny, tmp_path):
    """The tolerances of test_distributed_hjd against one process."""
    from frod_ds.hjd import decompose
    from frod_ds.model.store_reader import FactorStore
    from launch.eval import main as eval_main
    from tests.support.helpers_ckpt import weights

    def rel(a, b):
        return (torch.linalg.norm(a - b) / torch.linalg.norm(b)).item()

    store = FactorStore.open(pipeline["store"])
    assert store.manifest.world_size == 2 and store.complete
    for category, members in store.categories.items():
        Ws = [w.double() for w in weights(tiny.model, members)]
        V = store.load_V(category, torch.float64)
        ref = decompose(Ws, pi=store.pi, dtype=torch.float64)
        k = min(sum(w.shape[0] for w in Ws), V.shape[0])
        assert rel(V[:, :k] @ V[:, :k].T, ref.V[:, :k] @ ref.V[:, :k].T) < 1e-5, category
        for member, W in zip(members, Ws):
            U, sigma = store.load_U(member, torch.float64), store.load_sigma(member, torch.float64)
            assert rel((U * sigma) @ V.T, W) < 1e-5, member
    run = pipeline["run"]
    ref = tmp_path / "eval_ref"
    assert (
        eval_main(
            [
                "--checkpoint",
                str(run / "adapter-final"),
                "--data",
                str(tiny.data),
                "--tasks",
                TASKS,
                "--output",
                str(ref),
                "--batch-size",
                "4",
            ]
        )
        == 0
    )
    assert (run / "eval" / "predictions.jsonl").read_text() == (ref / "predictions.jsonl").read_text()
    got, want = (json.loads((d / "results.json").read_text())["tasks"] for d in (run / "eval", ref))
    assert got == want


# ---- a node fails mid-training ----------------------------------------------------------------------------


def _next_job_id(cluster: SlurmCluster) -> int:
    out = cluster.run(["scontrol", "show", "config"]).stdout
    return int(next(line.split("=")[1] for line in out.splitlines() if line.startswith("NEXT_JOB_ID")))


def _hold_port(cluster: SlurmCluster, tiny: Tiny, node: str, port: int) -> str:
    """A job of its own on ``node`` listening on ``port`` (on every address), until cancelled."""
    ready = tiny.root / f"holding-{port}"
    code = (
        f"import socket, time, pathlib; s = socket.socket(); s.bind(('', {port})); s.listen(); "
        f"pathlib.Path('{ready}').touch(); time.sleep(3600)"
    )
    res = cluster.run(
        [
            "sbatch",
            "--parsable",
            "--no-requeue",
            "-w",
            node,
            "-n",
            "1",
            "-o",
            "/dev/null",
            "--wrap",
            f'exec {sys.executable} -c "{code}"',
        ],
        env=tiny.env,
    )
    assert res.returncode == 0, res.stderr
    t0 = time.time()
    while not ready.exists():
        assert time.time() - t0 < pace.scaled(60), f"port holder on {node} did not start\n{cluster.logs()}"
        time.sleep(0.1)
    return res.stdout.strip().split(";")[0]


def _latest_tag(out: Path) -> int:
    tag = out / "checkpoints" / "latest_complete"
    return int(tag.read_text().removeprefix("step")) if tag.exists() else 0


def _kill_after_checkpoint(cluster: SlurmCluster, tiny: Tiny, job_id: str, out: Path, after: int, node: str) -> int:
    """Once a checkpoint newer than step ``after`` is sealed and a step past it logged, every process on
    ``node`` is killed; returns the checkpoint's step (where the job must resume)."""
    t0 = time.time()
    while not (_latest_tag(out) > after and _steps_done(out) > _latest_tag(out)):
        # between a failure and its restart the job passes through REQUEUED/COMPLETING: still alive
        assert cluster.job(job_id).state in (
            "PENDING",
            "RUNNING",
            "CONFIGURING",
            "REQUEUED",
            "REQUEUE_FED",
            "COMPLETING",
        ), _all_logs(tiny)
        assert time.time() - t0 < pace.scaled(600), f"no checkpoint after step {after}\n{_all_logs(tiny)}"
        time.sleep(0.1)
    restarts = cluster.job(job_id).restarts
    cluster.kill_node(node)
    t_fail = time.time()
    tag = _latest_tag(out)  # read once the node's processes are gone: a loaded host may seal one more meanwhile
    while cluster.job(job_id).restarts <= restarts:
        assert time.time() - t_fail < 120, f"job {job_id} not requeued 120 s after {node} failed\n{cluster.logs()}"
        time.sleep(0.3)
    print(f"\n{node} failed: requeued after {time.time() - t_fail:.1f} s", flush=True)
    return tag


def test_node_failure_requeues_and_resumes_on_the_nodes_left(cluster, tiny, single):
    """Training on n1+n2 (n3 held back until it runs) while a job of its own on n1 holds the port the training
    job's id derives; n1, the first node (rendezvous host and batch host), fails (every process on it killed):
    Slurm marks it DOWN and requeues the job, which resumes from its last sealed checkpoint on n2+n3 with
    MASTER_ADDR n2. The adapter equals the uninterrupted run's bit for bit."""
    out = tiny.root / "node_failure"
    assert cluster.run(["scontrol", "update", "nodename=n3", "state=drain", "reason=spare"]).returncode == 0
    derived = 20000 + (_next_job_id(cluster) + 1) % 20000  # the training job's id is the holder's + 1
    holder = _hold_port(cluster, tiny, "n1", derived)
    job_id = None
    try:
        job_id = _submit_train(cluster, tiny, single["store"], out, TWO_BY_ONE, "train.save_every=3")
        assert int(job_id) == int(holder) + 1
        _wait_for_step(cluster, tiny, job_id, out, 1)
        assert cluster.run(["scontrol", "update", "nodename=n3", "state=resume"]).returncode == 0
        tag = _kill_after_checkpoint(cluster, tiny, job_id, out, 0, "n1")
        assert cluster.node_state("n1").startswith("down"), cluster.node_state("n1")
        job = cluster.wait(job_id, timeout=600)
    finally:
        cluster.run(["scancel", holder])
        if "n1" not in cluster.procs:
            cluster.restart_node("n1")
        cluster.run(["scontrol", "update", "nodename=n3", "state=resume"])
        cluster.wait_nodes("idle", cluster.nodes, 60)
    log = _log(tiny, "frod-train", job_id)
    assert (job.state, job.exit_code) == ("COMPLETED", "0:0") and job.restarts >= 1, (job, log)
    assert job.fields["NodeList"] == "n[2-3]", job.fields
    assert f"resumed from step{tag:08d}" in log, log
    # the first start found the held port taken and took another; the last, without n1, meets on n2
    # a start's line may follow the unterminated output of a process killed with its node, on the same line
    marker = f"job {job_id}: "
    starts = [line[line.index(marker) :] for line in log.splitlines() if marker in line and " rendezvous " in line]
    assert "rendezvous n1:" in starts[0] and not starts[0].endswith(f"rendezvous n1:{derived}"), starts
    assert " rendezvous n2:" in starts[-1], starts
    assert [r["step"] for r in metrics(out)] == list(range(1, STEPS + 1))
    _assert_same_adapter(out / "adapter-final", single["run"] / "adapter-final")


# ---- a stop without requeue, resubmitted by hand; pipeline.sh's own errors ------------------------------------


def test_sigterm_without_requeue_then_the_same_submission_resumes_bitwise(cluster, tiny, single):
    """REQUEUE=0: the job checkpoints on SIGTERM and fails with 143; submitting the same command again resumes
    from that checkpoint and ends with the uninterrupted run's adapter."""
    out = tiny.root / "resubmitted"
    store = single["store"]
    first = _submit_train(cluster, tiny, store, out, TWO_BY_ONE, REQUEUE="0")
    _wait_for_step(cluster, tiny, first, out, 2)
    # the tasks held (SIGSTOP) while scancel's SIGTERM reaches them: a tiny step outruns the signal's path through
    # slurmctld otherwise, and the run could finish before it stops
    tasks = [p for n in _hostnames(cluster, cluster.job(first).fields["NodeList"]) for p in _task_pids(cluster, n)]
    for pid in tasks:
        os.kill(pid, signal.SIGSTOP)
    try:
        assert cluster.run(["scancel", "--signal=TERM", first]).returncode == 0
        time.sleep(1.0)
    finally:
        for pid in tasks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    job = cluster.wait(first, timeout=120)
    assert (job.state, job.exit_code, job.restarts) == ("FAILED", "143:0", 0), (job, _log(tiny, "frod-train", first))
    tag = _latest_tag(out)
    assert 2 <= tag < STEPS and not (out / "adapter-final").exists()
    second = cluster.wait(_submit_train(cluster, tiny, store, out, TWO_BY_ONE, REQUEUE="0"), timeout=600)
    assert (second.state, second.exit_code) == ("COMPLETED", "0:0"), (second, _log(tiny, "frod-train", second.id))
    assert f"resumed from step{tag:08d}" in _log(tiny, "frod-train", second.id)
    _assert_same_adapter(out / "adapter-final", single["run"] / "adapter-final")


def test_pipeline_with_the_gpu_defaults_is_refused_on_a_gpu_less_cluster(cluster, tiny):
    """Without GPUS_PER_NODE=0 the scripts ask for 8 GPUs a node: sbatch refuses, pipeline.sh exits non-zero and
    leaves nothing of its own queued."""
    before = cluster.run(["squeue", "-h", "-o", "%i"]).stdout.split()
    env = {
        **tiny.env,
        "MODEL": str(tiny.model),
        "STORE": str(tiny.root / "s2"),
        "DATA": str(tiny.data),
        "RUN": str(tiny.root / "r2"),
    }
    res = cluster.run([str(SLURM / "pipeline.sh")], env=env)
    assert res.returncode != 0 and "gres" in res.stderr.lower(), res.stdout + res.stderr
    assert cluster.run(["squeue", "-h", "-o", "%i"]).stdout.split() == before


@pytest.mark.parametrize("unset", ["MODEL", "RECIPE"])
def test_pipeline_without_an_input_says_what_to_set(cluster, tiny, unset):
    before = cluster.run(["squeue", "-h", "-o", "%i"]).stdout.split()
    env = {**tiny.env, "MODEL": str(tiny.model), "STORE": "s", "DATA": str(tiny.data), "RUN": "r"}
    env.pop(unset)
    res = cluster.run([str(SLURM / "pipeline.sh")], env=env)
    assert res.returncode == 2 and res.stderr.strip() == res.stderr.strip().splitlines()[0], res.stderr
    assert res.stderr.startswith(f"error: set {unset}"), res.stderr
    assert cluster.run(["squeue", "-h", "-o", "%i"]).stdout.split() == before


# ---- failures that must end a job quickly and say why ------------------------------------------------------


def test_a_killed_worker_ends_the_job_on_every_node_within_60s(cluster, tiny, single):
    """A rank killed (kill -9): srun ends the others with SIGTERM and exits 143 like a preempted step; the job
    must fail, not requeue itself as after a SIGTERM checkpoint (it would crash again, forever). Requeue left
    allowed, as a user submits it. Two tasks per node: srun ends the victim's neighbour and the other node's."""
    out = tiny.root / "killed_worker"
    job_id = _submit_train(cluster, tiny, single["store"], out, TWO_BY_TWO)
    _wait_for_step(cluster, tiny, job_id, out, 1)
    nodes = _hostnames(cluster, cluster.job(job_id).fields["NodeList"])
    victim = _task_pids(cluster, nodes[1])[0]
    os.kill(victim, 9)
    t0 = time.time()
    job = cluster.wait(job_id, timeout=60)
    while any(_task_pids(cluster, n) for n in nodes):
        assert time.time() - t0 < pace.scaled(60), {n: _task_pids(cluster, n) for n in nodes}
        time.sleep(0.2)
    print(f"\nkilled worker: job ended on every node in {time.time() - t0:.1f} s", flush=True)
    log = _log(tiny, "frod-train", job_id)
    assert (job.state, job.restarts) == ("FAILED", 0), (job, log)
    assert f"{nodes[1]}: task" in log and "Killed" in log, log
    assert "a task failed" in log and "requeueing" not in log, log


def test_a_path_on_one_node_only_fails_within_60s_naming_it(cluster, tiny, single):
    """/dev/shm is each node's own: an HJD --out there would be two half stores, a data file there exists on
    the first node only. Both jobs fail fast with a one-line error naming the path. (One rank per node: two
    nodes are what makes the paths differ, and half the ranks start twice as fast on a loaded machine.)"""
    shm = f"/dev/shm/frod-{cluster.tag}"
    assert cluster.on_node("n1", ["sh", "-c", f"mkdir -p {shm} && cp {tiny.data}/train.jsonl {shm}/"]).returncode == 0
    t0 = time.time()
    res = cluster.run(
        [str(SLURM / "submit.sh"), "--no-requeue", str(SLURM / "hjd.sbatch")],
        env={**tiny.env, **TWO_BY_ONE, "MODEL": str(tiny.model), "OUT": f"{shm}/store"},
    )
    assert res.returncode == 0, res.stderr
    jobs = {
        "hjd": (res.stdout.strip(), f"--out {shm}/store is not shared between the job's nodes: n2 cannot"),
        "train": (
            _submit_train(
                cluster,
                tiny,
                single["store"],
                tiny.root / "one_node_data",
                TWO_BY_ONE,
                sbatch=("--no-requeue",),
                data=Path(shm) / "train.jsonl",
            ),
            f"{shm}/train.jsonl",
        ),
    }
    for stage, (job_id, says) in jobs.items():
        job = cluster.wait(job_id, timeout=max(1.0, 60 - (time.time() - t0) / pace.factor()))
        log = _log(tiny, f"frod-{stage}", job_id)
        assert job.state == "FAILED", (job, log)
        errors = [line for line in log.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and says in errors[0], log
    print(f"\npaths on one node: both jobs failed in {time.time() - t0:.1f} s", flush=True)


# ---- the GPU each srun task takes (no GPU here: CUDA and the process group faked) ---------------------------


@pytest.mark.parametrize("visible,local_id,want", [(8, "3", 3), (1, "3", 0)])
def test_srun_task_takes_the_gpu_of_its_local_id(monkeypatch, visible, local_id, want):
    """``--ntasks-per-node`` = GPUs per node: task SLURM_LOCALID k uses GPU k of the node; where srun gives each
    task one visible GPU (``--gpus-per-task=1`` / ``--gpu-bind``), GPU 0 of what it sees."""
    import frod_ds.runtime.distributed as D
    from frod_ds.runtime.launch_env import process_group_spec

    env = {
        "SLURM_PROCID": "11",
        "SLURM_STEP_NUM_TASKS": "16",
        "SLURM_LOCALID": local_id,
        "SLURM_STEP_NODELIST": "gpu[007-008]",
        "SLURM_JOB_ID": "77",
        "MASTER_ADDR": "gpu007",
        "MASTER_PORT": "20077",
    }
    joined, devices = {}, []
    monkeypatch.setattr(D, "_local_rank", 0)  # restored after the test: no process-wide state left
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    monkeypatch.setattr(D.dist, "init_process_group", lambda **kw: joined.update(kw))
    D._join(process_group_spec(env), None)
    assert joined["backend"] == "nccl" and joined["init_method"] == "tcp://gpu007:20077"
    assert (joined["rank"], joined["world_size"]) == (11, 16)
    # set in the main thread and in the join's helper thread (the current CUDA device is per thread)
    assert devices == [want, want] and joined["device_id"] == torch.device("cuda", want)
