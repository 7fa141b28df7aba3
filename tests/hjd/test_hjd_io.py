"""The HJD stage's I/O pieces on the CPU: read-ahead order and accounting, planned part files."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from frod_ds.formats.factor_store import part_file
from frod_ds.hjd.sharding import my_members, targeted_members
from frod_ds.hjd.streaming import FactorWriter, MemberReader, plan_parts
from frod_ds.io.hf_checkpoint import HFCheckpoint
from frod_ds.runtime.atomic import TMP
from tests.support import pace
from tests.support.helpers_ckpt import REPO, weights, write_tiny_llama
from tests.support.leftovers import clean_env

Q = [f"model.layers.{i}.self_attn.q_proj" for i in range(3)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("io") / "model")


def test_reader_returns_each_weight_in_any_take_order(model):
    ckpt = HFCheckpoint(model)
    nbytes = ckpt.info(Q[0] + ".weight").nbytes
    reader = MemberReader(ckpt, torch.device("cpu"), threads=2, ahead_bytes=nbytes)  # one read ahead at most
    try:
        reader.schedule(Q)
        assert len(reader._inflight) == 1 and len(reader._plan) == 2, "the byte budget holds the rest back"
        expect = dict(zip(Q, weights(model, Q)))
        assert torch.equal(reader.take(Q[2]), expect[Q[2]]), "taken out of order: read at once"
        assert torch.equal(reader.take(Q[0]), expect[Q[0]])
        assert torch.equal(reader.take(Q[1]), expect[Q[1]])
        assert torch.equal(reader.take(Q[1]), expect[Q[1]]), "never scheduled: read when taken"
        assert ckpt.tensors_read == 4 and ckpt.bytes_read == 4 * nbytes
    finally:
        reader.close()


def test_reader_reports_a_shard_cut_short_after_its_header_was_read(tmp_path):
    model = write_tiny_llama(tmp_path / "model")
    ckpt = HFCheckpoint(model)
    info = ckpt.info(Q[0] + ".weight")  # header read and checked now
    with open(info.file, "r+b") as f:
        f.truncate(info.start + 4)  # then the file is replaced by a partial download
    reader = MemberReader(ckpt, torch.device("cpu"), threads=1)
    try:
        reader.schedule([Q[0]])
        with pytest.raises(ValueError, match="could not read .*q_proj.*download the checkpoint again"):
            reader.take(Q[0])
    finally:
        reader.close()


def test_plan_parts_closes_a_part_at_the_size_and_never_splits_a_member():
    entry = lambda m: (m, [(m + ".U", torch.bfloat16, (4, 8)), (m + ".sigma", torch.float32, (8,))])  # noqa: E731
    members = [entry(f"m{i}") for i in range(5)]  # 96 bytes each
    assert plan_parts(members, 200) == [["m0", "m1", "m2"], ["m3", "m4"]]
    assert plan_parts(members, 1) == [[f"m{i}"] for i in range(5)]
    assert plan_parts(members, 1e9) == [[f"m{i}" for i in range(5)]]


def test_writer_files_load_with_safetensors(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {f"m{i}": (torch.randn(3 + i, 8, generator=g).bfloat16(), torch.rand(8, generator=g)) for i in range(4)}
    writer = FactorWriter(tmp_path, fsync=True, part_bytes=100, threads=2)
    try:
        writer.begin(
            "q_proj",
            1,
            [
                (m, [(m + ".U", torch.bfloat16, tuple(U.shape)), (m + ".sigma", torch.float32, (8,))])
                for m, (U, _) in tensors.items()
            ],
        )
        for m, (U, s) in tensors.items():
            writer.add(m + ".U", U)
            writer.add(m + ".sigma", s)
        files, writes = writer.finish()
        for w in writes:
            w.result()
    finally:
        writer.close()
    assert len(set(files.values())) == 3 and all(f.startswith("q_proj.rank00001.part") for f in files.values())
    assert not list(tmp_path.glob(f"*{TMP}"))
    for m, (U, s) in tensors.items():
        with safe_open(str(tmp_path / files[m + ".U"]), framework="pt") as f:
            assert torch.equal(f.get_tensor(m + ".U"), U) and torch.equal(f.get_tensor(m + ".sigma"), s)


def test_a_full_disk_at_a_parts_header_leaves_no_temporary_and_names_the_part(tmp_path, monkeypatch):
    """The disk fills while the plan opens its parts (the second part's header): the error names that part, and
    neither its temporary nor the first part's stays in the store."""
    import errno

    from frod_ds.hjd import streaming

    real, calls = os.pwrite, []

    def pwrite(fd, data, offset):
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(streaming.os, "pwrite", pwrite)
    members = [(f"m{i}", [(f"m{i}.U", torch.bfloat16, (4, 8)), (f"m{i}.sigma", torch.float32, (8,))]) for i in range(3)]
    writer = FactorWriter(tmp_path, fsync=False, part_bytes=100, threads=1)
    try:
        with pytest.raises(OSError) as e:
            writer.begin("q_proj", 0, members)
    finally:
        writer.close()
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / part_file("q_proj", 0, 1))
    assert sorted(tmp_path.iterdir()) == []


def test_plan_helpers_and_torch_free_import(model):
    members = targeted_members(HFCheckpoint(model).keys(), ["q_proj", "up_proj"])
    assert members["q_proj"] == Q and len(members["up_proj"]) == 3
    assert (
        my_members(Q, 1, 2) == Q[2:]
        and my_members(Q, 2, 4) == Q[2:]
        and my_members(Q, 3, 4) == []
        and my_members(Q, 0, 1) == Q
    )
    code = (
        "import sys; import frod_ds.hjd.sharding, frod_ds.io.hf_checkpoint, launch.hjd; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_readahead_hint_runs_over_the_members(model):
    ckpt = HFCheckpoint(model)
    thread = ckpt.readahead([q + ".weight" for q in Q], budget_bytes=1e9)
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_readahead_budget_is_shared_by_the_ranks_of_a_node(monkeypatch):
    import frod_ds.hjd.sharding as plan
    from frod_ds.runtime.launch_env import ranks_on_this_node

    for key in ("LOCAL_WORLD_SIZE", "SLURM_STEP_TASKS_PER_NODE", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(plan.os, "sysconf", {"SC_AVPHYS_PAGES": 2**20, "SC_PAGE_SIZE": 4096}.__getitem__)  # 4 GiB free
    assert ranks_on_this_node() == 1 and plan.readahead_budget() == 2**30
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "8(x2)")
    assert ranks_on_this_node() == 8 and plan.readahead_budget() == 2**27
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert ranks_on_this_node() == 4 and plan.readahead_budget() == 2**28


def test_cpu_threading_of_launch_hjd_respects_the_user_and_shares_the_cores(monkeypatch):
    """CPU runs without OMP_NUM_THREADS: OpenMP threads wait passively and a rank takes torch's default
    thread count divided by the ranks on the node; an explicit OMP_NUM_THREADS / OMP_WAIT_POLICY is kept.
    Once in a fresh interpreter (the policy set before torch loads, torch's own default divided), then each rule
    in this process, on an environment of its own, with torch's thread count calls recorded."""
    import argparse
    import os

    import frod_ds.cli.hjd as h

    code = (
        "import argparse, os; import launch.hjd as h; ns = argparse.Namespace(device='cpu'); "
        "h._cpu_threading_env(ns); import torch; default = torch.get_num_threads(); h._set_cpu_threads(ns); "
        "print(os.environ.get('OMP_WAIT_POLICY'), default, torch.get_num_threads())"
    )
    clean = {k: v for k, v in clean_env().items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**clean, "LOCAL_WORLD_SIZE": "2"},
        capture_output=True,
        text=True,
        timeout=pace.scaled(120),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    policy, default, threads = proc.stdout.split()
    assert policy == "PASSIVE" and int(threads) == max(1, int(default) // 2), proc.stdout

    set_to: list[int] = []
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def run(device: str = "cpu", **env: str) -> tuple[str, int]:
        monkeypatch.setattr(os, "environ", dict(env))
        set_to[:] = [8]
        ns = argparse.Namespace(device=device)
        h._cpu_threading_env(ns)
        h._set_cpu_threads(ns)
        return str(os.environ.get("OMP_WAIT_POLICY")), set_to[-1]

    assert run() == ("PASSIVE", 8)
    assert run(LOCAL_WORLD_SIZE="2") == ("PASSIVE", 4)
    assert run(SLURM_STEP_TASKS_PER_NODE="16") == ("PASSIVE", 1)
    assert run(OMP_NUM_THREADS="1", LOCAL_WORLD_SIZE="2") == ("None", 8)
    assert run(OMP_WAIT_POLICY="ACTIVE") == ("ACTIVE", 8)
    assert run("cuda") == ("None", 8)
    assert run("auto", LOCAL_WORLD_SIZE="4") == ("PASSIVE", 2)  # no GPU here: a CPU run


def test_hjd_on_cuda_without_a_gpu_says_to_use_the_cpu(monkeypatch):
    """``frod hjd --device cuda`` where no GPU is visible: the same line every command's device check gives, with
    what to do (``--device cpu``), not only what is wrong."""
    import pytest
    import torch

    from frod_ds.hjd import stage
    from frod_ds.runtime.errors import HJDError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = type("Cfg", (), {"device": "cuda"})()
    with pytest.raises(HJDError) as e:
        stage._device(cfg)
    assert str(e.value) == "--device cuda but no CUDA device is visible to this process; use --device cpu"
