"""Distributed HJD stage under ``torchrun --standalone --nproc_per_node 2`` (gloo, CPU).

Assertions read the store on disk (manifest + safetensors), never the workers' stdout.
"""

from __future__ import annotations

import dataclasses
import json
import textwrap

import pytest
import torch

from frod_ds.formats.ownership import MARKER
from frod_ds.hjd.math import decompose
from frod_ds.hjd.routes import make_blocks
from frod_ds.hjd.sharding import split_counts
from frod_ds.model.store_reader import FactorStore
from frod_ds.runtime.atomic import TMP
from frod_ds.runtime.errors import FrodError
from tests.support import pace
from tests.support.helpers_ckpt import REPO, run_hjd, weights, write_tiny_llama

pytestmark = pytest.mark.slow

# hidden 64, 4 heads, 1 KV head: k_proj/v_proj are (16, 64); over 3 layers Σm = 48 < n = 64 (wide), and
# each rank's local stack is wide too. 3 layers over 2 ranks: an odd split (2 + 1).
WIDE = dict(hidden_size=64, intermediate_size=80, num_attention_heads=4, num_key_value_heads=1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (torch.linalg.norm(a - b) / torch.linalg.norm(b)).item()


def _assert_store_equals_decompose(store: FactorStore, model_dir, tol: float = 1e-6) -> None:
    """Every category against single-process ``decompose`` in fp64 (relative Frobenius within ``tol``):
    each member's reconstruction; ``V`` and ``σ`` where they are unique.

    With one member, or a wide category (Σ m_i <= n: ``Q`` square orthogonal, so the ``Q_iᵀQ_i`` are
    complementary orthogonal projections), ``T_pi = c·I``: its eigenbasis ``Z`` (hence ``V``, ``σ``) is
    arbitrary in any implementation. There the invariants are compared: ``V_k V_kᵀ = RᵀR = WᵀW`` and the
    projector onto the completion directions.
    """
    for category, members in store.categories.items():
        Ws = [w.double() for w in weights(model_dir, members)]
        ref = decompose(Ws, pi=store.pi, dtype=torch.float64)
        V = store.load_V(category, torch.float64)
        M, n = sum(w.shape[0] for w in Ws), V.shape[0]
        k, unique = min(M, n), M > n and len(Ws) > 1
        if unique:
            assert _rel(V, ref.V) < tol, category
        else:
            assert _rel(V[:, :k] @ V[:, :k].T, ref.V[:, :k] @ ref.V[:, :k].T) < tol, category
            assert _rel(V[:, k:] @ V[:, k:].T, ref.V[:, k:] @ ref.V[:, k:].T) < tol, category
        for i, (member, W) in enumerate(zip(members, Ws)):
            U, sigma = store.load_U(member, torch.float64), store.load_sigma(member, torch.float64)
            assert _rel((U * sigma) @ V.T, W) < tol, member
            if unique:
                assert _rel(sigma, ref.sigma[i]) < tol, member
            assert store.manifest.categories[category].error[member] < 1e-12, "fp64 HJD error recorded"


@pytest.fixture(scope="module")
def two_rank_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    model = write_tiny_llama(root / "model", **WIDE)
    # A tiny --block-gb puts every member in its own block: both TSQR levels (in-rank and across ranks) run.
    proc = run_hjd(
        ["--model", str(model), "--out", str(root / "store"), "--dtype", "float64", "--block-gb", "1e-6"], nproc=2
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return model, root / "store"


def test_distributed_hjd_equals_single_process(two_rank_store):
    model, path = two_rank_store
    store = FactorStore.open(path)
    assert store.manifest.world_size == 2 and store.manifest.hjd_dtype == "float64"
    _assert_store_equals_decompose(store, model)


def test_distributed_hjd_odd_layers_split_contiguously(two_rank_store):
    _, path = two_rank_store
    store = FactorStore.open(path)
    files = store.manifest.categories["q_proj"].files
    owner = {m: files[m + ".U"].split(".")[1] for m in store.categories["q_proj"]}
    assert owner == {
        "model.layers.0.self_attn.q_proj": "rank00000",
        "model.layers.1.self_attn.q_proj": "rank00000",
        "model.layers.2.self_attn.q_proj": "rank00001",
    }
    assert files["q_proj.V"] == "q_proj.V.safetensors"


def test_distributed_hjd_each_rank_reads_only_its_members(two_rank_store):
    _, path = two_rank_store
    store = FactorStore.open(path)
    ranks = store.manifest.run.ranks
    per_rank = [0, 0]
    for category, members in store.categories.items():
        for i, member in enumerate(members):
            m, n = store.member_shape(member)
            per_rank[0 if i < 2 else 1] += m * n * 4  # fp32 checkpoint; rank 0 owns layers 0-1
    # Each owned weight is read once (kept in the device cache between the passes), nothing else.
    assert [r.bytes_read for r in ranks] == per_rank


def test_distributed_hjd_route_per_category(two_rank_store):
    """Tall full-rank stacks take the Gram route; the wide k/v stacks fall back to Householder TSQR."""
    _, path = two_rank_store
    cats = FactorStore.open(path).manifest.categories
    assert {c: spec.method for c, spec in cats.items()} == {
        "q_proj": "gram",
        "k_proj": "householder",
        "v_proj": "householder",
        "o_proj": "gram",
        "gate_proj": "gram",
        "up_proj": "gram",
    }
    assert cats["k_proj"].cond_estimate is None and 1 <= cats["q_proj"].cond_estimate < 1e3


def test_distributed_hjd_wide_category_has_zero_completion(two_rank_store):
    _, path = two_rank_store
    store = FactorStore.open(path)
    assert sum(store.member_shape(m)[0] for m in store.categories["k_proj"]) == 48 < store.width("k_proj") == 64
    for member in store.categories["k_proj"]:
        sigma = store.load_sigma(member)
        assert torch.all(sigma[48:] == 0) and torch.count_nonzero(store.load_U(member)[:, 48:]) == 0
    assert torch.linalg.matrix_rank(store.load_V("k_proj", torch.float64)) == 64


def test_distributed_hjd_more_ranks_than_members(tmp_path):
    model = write_tiny_llama(tmp_path / "model", num_hidden_layers=2, **WIDE)
    proc = run_hjd(
        [
            "--model",
            str(model),
            "--out",
            str(tmp_path / "store"),
            "--dtype",
            "float64",
            "--targets",
            "q_proj,k_proj,up_proj",
        ],
        nproc=3,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    store = FactorStore.open(tmp_path / "store")
    owners = {f.split(".")[1] for f in store.manifest.categories["q_proj"].files.values()}
    assert owners == {"V", "rank00000", "rank00001"}
    assert store.manifest.run.ranks[2].tensors_read == 0, "rank 2 has no members and reads nothing"
    _assert_store_equals_decompose(store, model)


KILLER = """
import os, signal, sys
sys.path.insert(0, {repo!r})
import frod_ds.hjd.store_writer as store_dir

_record = store_dir.record_category

def die_before_recording(out, manifest, category, outs, seconds, writer):
    if category == os.environ["HJD_KILL_AFTER"]:
        writer.flush()  # the earlier categories' manifest updates are on disk
        os.kill(os.getpid(), signal.SIGKILL)  # this category's files written, manifest not updated: a killed run
    return _record(out, manifest, category, outs, seconds, writer)

store_dir.record_category = die_before_recording
from launch.hjd import main
sys.exit(main())
"""


def test_distributed_hjd_resumes_after_kill(tmp_path, monkeypatch):
    model = write_tiny_llama(tmp_path / "model", **WIDE)
    out = tmp_path / "store"
    args = ["--model", str(model), "--out", str(out), "--dtype", "float64", "--targets", "q_proj", "k_proj", "v_proj"]
    killer = tmp_path / "kill_hjd.py"
    killer.write_text(textwrap.dedent(KILLER.format(repo=str(REPO))))
    monkeypatch.setenv("HJD_KILL_AFTER", "k_proj")
    proc = run_hjd(args, nproc=2, script=killer)
    assert proc.returncode != 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] is False and manifest["completed_categories"] == ["q_proj"]
    with pytest.raises(ValueError, match="incomplete"):
        FactorStore.open(out)
    assert any(p.name.startswith("k_proj.rank") for p in out.iterdir()), "the killed category left files"
    (out / "v_proj.rank00001.part0000.safetensors.frod-tmp").write_bytes(b"half a file")
    q_files = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("q_proj.*")}

    monkeypatch.delenv("HJD_KILL_AFTER")
    proc = run_hjd(args, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    store = FactorStore.open(out)
    assert store.manifest.run.categories_skipped == ["q_proj"]
    assert store.manifest.run.categories_done == ["k_proj", "v_proj"]
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("q_proj.*")} == q_files, "q_proj kept"
    assert not [p for p in out.iterdir() if p.name.endswith(TMP)]
    listed = {f for spec in store.manifest.categories.values() for f in spec.files.values()}
    assert {p.name for p in out.iterdir()} == listed | {"manifest.json", MARKER}, "no stale files"
    _assert_store_equals_decompose(store, model)


def test_split_counts_and_blocks():
    assert split_counts(3, 2) == [2, 1] and split_counts(1, 3) == [1, 0, 0] and split_counts(80, 8) == [10] * 8
    assert make_blocks([4, 4, 4], n=2, itemsize=4, block_bytes=64) == [range(0, 2), range(2, 3)]
    assert make_blocks([100], n=2, itemsize=4, block_bytes=8) == [range(0, 1)], "a member never splits"
    assert make_blocks([], n=2, itemsize=4, block_bytes=8) == []


def test_launcher_env_maps_srun():
    from frod_ds.runtime.launch_env import ProcessGroupSpec, first_slurm_host, process_group_spec

    env = {
        "SLURM_PROCID": "5",
        "SLURM_STEP_NUM_TASKS": "16",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_NODELIST": "gpu[007-008,012],cpu1",
        "SLURM_JOB_ID": "123",
    }
    before = dict(env)
    assert process_group_spec(env) == ProcessGroupSpec(5, 16, 1, "tcp://gpu007:20123")
    assert env == before, "the environment is only read"
    exported = {**env, "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29400"}  # as an sbatch script exports them
    assert process_group_spec(exported).init_method == "tcp://10.0.0.7:29400"
    faked = {**env, "SLURM_JOB_ID": "abc"}  # Slurm sets digits: the port cannot be derived from it
    with pytest.raises(FrodError, match="SLURM_JOB_ID='abc' is no job number .*export MASTER_PORT"):
        process_group_spec(faked)
    assert process_group_spec({**faked, "MASTER_PORT": "29400"}).init_method == "tcp://gpu007:29400"
    assert first_slurm_host("node1") == "node1"
    sbatch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}
    assert process_group_spec(sbatch) is None, "plain python inside sbatch stays one process"
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}
    assert process_group_spec(torchrun) == ProcessGroupSpec(1, 2, 1, "env://"), "torchrun / deepspeed launcher"


def test_small_part_files_split_a_block_and_still_equal_decompose(tmp_path):
    """--part-mb smaller than one member: every member's U/σ lands in its own part file of the one block."""
    model = write_tiny_llama(tmp_path / "model", **WIDE)
    proc = run_hjd(
        ["--model", str(model), "--out", str(tmp_path / "store"), "--dtype", "float64", "--part-mb", "1e-6"], nproc=0
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    store = FactorStore.open(tmp_path / "store")
    files = store.manifest.categories["q_proj"].files
    members = store.categories["q_proj"]
    assert len({files[m + ".U"] for m in members}) == len(members)
    assert all(files[m + ".U"] == files[m + ".sigma"] for m in members)
    _assert_store_equals_decompose(store, model)


@pytest.mark.parametrize("method", ["auto", "householder"])
def test_no_device_cache_rereads_and_still_equals_decompose(tmp_path, method):
    """--device-cache-gb 0: nothing stays between passes, so weights are read again (and Gram matrices
    recomputed); fp32 weights, both routes, 2 ranks, against ``decompose``."""
    model = write_tiny_llama(tmp_path / "model", **WIDE)
    out = tmp_path / "store"
    proc = run_hjd(
        [
            "--model",
            str(model),
            "--out",
            str(out),
            "--dtype",
            "float64",
            "--device-cache-gb",
            "0",
            "--method",
            method,
            "--targets",
            "q_proj,k_proj",
            "--block-gb",
            "1e-6",
        ],
        nproc=2,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    store = FactorStore.open(out)
    cats = store.manifest.categories
    assert cats["q_proj"].method == ("gram" if method == "auto" else "householder")
    assert cats["k_proj"].method == "householder"
    owned = sum(
        m * n * 4 for c in ("q_proj", "k_proj") for m, n in (store.member_shape(x) for x in store.categories[c][:2])
    )
    # rank 0: every pass reads again -- Gram pass, then (Gram route) T_pi pass + factors, or (Householder)
    # local QR + factors
    assert store.manifest.run.ranks[0].bytes_read == 3 * owned
    _assert_store_equals_decompose(store, model)


def test_gram_route_error_check_falls_back_to_householder(tmp_path, monkeypatch):
    """A Gram-route category whose measured reconstruction error exceeds the limit is redone by the
    Householder route (files rewritten, manifest says so); one process, in this interpreter."""
    import frod_ds.hjd.routes as routes
    from frod_ds.hjd.stage import StageConfig, run_stage

    model = write_tiny_llama(tmp_path / "model", **WIDE)
    monkeypatch.setattr(routes, "GRAM_MAX_ERROR", {torch.float32: 0.0, torch.float64: 0.0})
    manifest = run_stage(
        StageConfig(
            model=str(model), out=tmp_path / "store", targets=("q_proj", "up_proj"), dtype=torch.float64, device="cpu"
        )
    )
    assert manifest.complete
    assert {c: s.method for c, s in manifest.categories.items()} == {"q_proj": "householder", "up_proj": "householder"}
    assert manifest.categories["q_proj"].cond_estimate >= 1, "the Gram route ran first"
    assert not [p for p in (tmp_path / "store").iterdir() if p.name.endswith(TMP)]
    _assert_store_equals_decompose(FactorStore.open(tmp_path / "store"), model)


def test_a_complete_store_asked_again_is_left_as_it_was(tmp_path, capsys):
    """HJD into a store that already holds every category asked for runs nothing and writes nothing: its manifest
    keeps the record of the run that built it (bytes read, seconds) instead of a record of doing nothing."""
    from frod_ds.hjd.stage import StageConfig, run_stage

    model = write_tiny_llama(tmp_path / "model", **WIDE)
    cfg = StageConfig(model=str(model), out=tmp_path / "store", targets=("q_proj", "k_proj"), device="cpu")
    built = run_stage(cfg)
    assert built.complete and built.run.categories_done == ["q_proj", "k_proj"]
    files = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in (tmp_path / "store").iterdir()}
    capsys.readouterr()
    for again in (cfg, dataclasses.replace(cfg, categories=("k_proj",))):
        assert run_stage(again) is None
        assert "already holds every category asked for, complete: nothing to do" in capsys.readouterr().out
        assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in (tmp_path / "store").iterdir()} == files


def test_a_store_stopped_before_its_completion_mark_is_named_so_and_finished_by_the_same_command(tmp_path):
    """HJD killed after its last category was recorded but before the store was marked complete: readers say the
    run stopped before the mark (no "missing: []"), and the same command marks it without redoing a category."""
    from frod_ds.hjd.stage import StageConfig, run_stage
    from frod_ds.runtime.errors import StoreError

    model = write_tiny_llama(tmp_path / "model", **WIDE)
    store = tmp_path / "store"
    cfg = StageConfig(model=str(model), out=store, targets=("q_proj", "k_proj"), device="cpu")
    run_stage(cfg)
    doc = json.loads((store / "manifest.json").read_text())
    (store / "manifest.json").write_text(json.dumps({**doc, "complete": False}, indent=1))  # as the kill leaves it
    record = json.loads((store / ".frod-ds-output").read_text())
    (store / ".frod-ds-output").write_text(json.dumps({**record, "written": None}))  # stamped only once marked
    factors = {p.name: p.read_bytes() for p in store.glob("*.safetensors")}
    with pytest.raises(StoreError, match=f"was not finished: every category is in, .*--model {model} --out {store}"):
        FactorStore.open(store)
    finished = run_stage(cfg)
    assert finished.complete and finished.run.categories_done == [] and FactorStore.open(store).complete
    assert {p.name: p.read_bytes() for p in store.glob("*.safetensors")} == factors


def test_device_cache_keeps_weights_before_gram_matrices(tmp_path):
    """A cache that holds every weight but not the Gram matrices as well: the weights stay (each read once)
    and the Gram matrices are recomputed. (Caching in arrival order would keep G_0 and read W_2 again.)"""
    from frod_ds.hjd.stage import StageConfig, run_stage

    model = write_tiny_llama(tmp_path / "model", **WIDE)  # fp32 q_proj 64 x 64: W 16 KiB, G (fp64) 32 KiB
    manifest = run_stage(
        StageConfig(
            model=str(model),
            out=tmp_path / "store",
            targets=("q_proj",),
            dtype=torch.float64,
            device="cpu",
            device_cache_gb=64 * 2**10 / 2**30,
        )
    )
    assert manifest.categories["q_proj"].method == "gram"
    assert manifest.run.ranks[0].bytes_read == 3 * 64 * 64 * 4
    _assert_store_equals_decompose(FactorStore.open(tmp_path / "store"), model)


def test_srun_style_environment_runs_the_stage(tmp_path):
    """Two plain ``python launch/hjd.py`` processes with the SLURM variables srun sets (no torchrun, no
    RANK/WORLD_SIZE/MASTER_ADDR): they find each other and build the single-process store."""
    import subprocess
    import sys

    from tests.support.helpers_ckpt import LAUNCH
    from tests.support.leftovers import clean_env, free_port

    model = write_tiny_llama(tmp_path / "model")
    port = free_port()
    base = clean_env()
    procs = []
    for rank in range(2):
        env = dict(
            base,
            OMP_NUM_THREADS="1",
            PYTHONPATH=str(REPO),
            CUDA_VISIBLE_DEVICES="",
            SLURM_PROCID=str(rank),
            SLURM_LOCALID=str(rank),
            SLURM_STEP_NUM_TASKS="2",
            SLURM_STEP_NODELIST="localhost",
            SLURM_JOB_ID="1",
            MASTER_PORT=str(port),
        )  # MASTER_PORT as an sbatch script exports it
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    str(LAUNCH),
                    "--model",
                    str(model),
                    "--out",
                    str(tmp_path / "store"),
                    "--dtype",
                    "float64",
                    "--targets",
                    "q_proj",
                    "--device",
                    "cpu",
                ],
                env=env,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = [p.communicate(timeout=pace.scaled(180)) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    store = FactorStore.open(tmp_path / "store")
    assert store.manifest.world_size == 2
    _assert_store_equals_decompose(store, model)
