"""The chain kind end to end on a CPU rank under torchrun (``bench/suites/chain-tiny.toml``): each category is
decomposed and deleted, training reads the stripped checkpoint, the killed run's losses are the resumed run's bit
for bit, every stage leaves a valid record, and a second run redoes nothing. The numbers are checked against the
files the runs wrote and against weights generated here independently of the generator."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

import pytest
import torch
from safetensors import safe_open

from bench.kinds import synthetic
from bench.kinds.chain import STAGES, shape_of
from bench.kinds.chain_report import render
from bench.record import Record, read_records, record_path
from bench.suite import BenchError, load_suite
from frod_ds.formats.factor_store import MANIFEST, Manifest
from frod_ds.io.hf_checkpoint import HFCheckpoint
from frod_ds.model.store_reader import FactorStore, check_store_matches
from tests.support import pace, ranks
from tests.support.helpers_ckpt import REPO
from tests.support.leftovers import clean_env

SUITE = REPO / "bench" / "suites" / "chain-tiny.toml"


def _bench(*args: str) -> subprocess.CompletedProcess:
    """``python -m bench ARGS``, forked from this worker (``tests.support.ranks.run``); the stages it launches are
    fresh interpreters under torchrun, as on a GPU machine."""
    return ranks.run(0, ["-m", "bench", *args], clean_env(), REPO, 200)


def test_a_chain_suite_refuses_a_kill_that_would_not_follow_its_checkpoint(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('kind = "chain"\n[[configs]]\nsteps = 20\nsave_at = 10\nkill_at = 21\n')
    with pytest.raises(BenchError, match="need save_at < kill_at < min"):
        load_suite(path)
    path.write_text('kind = "chain"\n[[configs]]\nlayers = 20\n')
    assert [c.name for c in load_suite(path).configs] == ["70b-l20-4g"]
    path.write_text('kind = "chain"\n[[configs]]\nnvme_path = "nvme"\n')
    with pytest.raises(BenchError, match="nvme_path 'nvme' must be an absolute folder"):
        load_suite(path)
    nvme = load_suite(REPO / "bench" / "suites" / "nvme-7b-train-1gpu.toml").configs[0].settings
    assert (nvme["config"], nvme["nvme_path"]) == ("ds_configs/zero3_nvme.json", "/tmp/frod-bench-nvme")


def test_a_run_is_measured_on_its_own_gpus_and_a_failure_names_frods_error_line():
    from bench.kinds.chain import failure, run_gpus
    from bench.kinds.chain_report import in_use_over_planner, per_rank

    assert run_gpus(2, {}) == ["0", "1"]
    assert run_gpus(1, {"CUDA_VISIBLE_DEVICES": "1,0"}) == ["1"]
    assert run_gpus(2, {"CUDA_VISIBLE_DEVICES": "GPU-3f2a,GPU-77c1"}) == ["0", "1"]  # UUIDs: the launcher's order
    # a record from before: the driver's reading of both GPUs for a one-rank run, the second another job's
    fig = {"gpu_in_use_gib_per_rank": {"0": 3.9, "1": 14.1}, "host_peak_rss_gib_per_rank": {"0": 11.9}}
    assert per_rank(fig, "gpu_in_use_gib_per_rank", 1) == {"0": 3.9}
    assert in_use_over_planner(fig, {"needed_gib": 2.5}, 1) == pytest.approx(3.9 / 2.5)
    log = [
        "python -m torch.distributed.run --nproc-per-node 1 -m frod_ds train",
        "[rank0]: error: NVMe offload builds DeepSpeed's async_io op, whose builder cannot parse ...",
        *["torch.distributed.elastic ... ChildFailedError"] * 40,
    ]
    text = failure("exit code 1", log)
    assert text.splitlines()[0] == f"exit code 1: {log[1]}" and text.splitlines()[1:] == log[-30:]
    assert failure("timeout", log[2:]).splitlines()[0] == "timeout"


def test_a_chains_omp_threads_reach_the_run_and_are_checked(tmp_path):
    """``omp_threads`` sets the training runs' OMP_NUM_THREADS (torchrun sets 1 for several ranks unless it is set);
    0 leaves the launcher's; a negative count is refused with the suite."""
    from bench.kinds.chain import watch

    probe = [sys.executable, "-c", "import os; print('omp', os.environ.get('OMP_NUM_THREADS'))"]
    watch(probe, tmp_path / "a.log", 60, extra_env={"OMP_NUM_THREADS": "16"})
    assert "omp 16" in (tmp_path / "a.log").read_text()
    path = tmp_path / "c.toml"
    path.write_text('kind = "chain"\n[[configs]]\nomp_threads = -1\n')
    with pytest.raises(BenchError, match="omp_threads must be positive integers"):
        load_suite(path)
    (cfg, omp, dense) = load_suite(REPO / "bench" / "suites" / "offload-7b-train-2gpu.toml").configs
    assert (cfg.settings["omp_threads"], omp.settings["omp_threads"], omp.name) == (0, 16, "7b-2g-omp16")
    assert (cfg.settings["sparsity"], dense.settings["sparsity"], dense.name) == (0.02, 0.05, "7b-2g-s05")


@pytest.mark.parametrize(
    "key, bad, said",
    [("sparsity", v, "sparsity must be a number between 0 and 1") for v in ("0.0", "1.5", '"0.05"', "1")]
    + [("phase_times", v, "phase_times must be true or false") for v in ('"yes"', "1")],
)
def test_a_chains_sparsity_and_phase_times_are_checked(tmp_path, key, bad, said):
    path = tmp_path / "c.toml"
    path.write_text(f'kind = "chain"\n[[configs]]\n{key} = {bad}\n')
    with pytest.raises(BenchError, match=said):
        load_suite(path)


def test_a_part_is_the_same_files_whoever_writes_it_and_leaves_the_index_when_deleted(tmp_path, monkeypatch):
    monkeypatch.setattr(synthetic, "FILE_BYTES", 20_000)  # several files per part
    shape, cpu = load_suite(SUITE).configs[0].settings, torch.device("cpu")
    shape = shape_of(shape)
    one, two = tmp_path / "one", tmp_path / "two"
    for d in (one, two):
        d.mkdir()
    synthetic.write_part(one, shape, "base", 0, cpu, 0, 1)
    assert synthetic.write_part(two, shape, "base", 0, cpu, 1, 2) > 0  # rank 1 of 2, then rank 0
    synthetic.write_part(two, shape, "base", 0, cpu, 0, 2)
    assert synthetic.write_part(two, shape, "base", 0, cpu, 0, 2) == 0  # present: not written again
    files = sorted(p.name for p in one.iterdir())
    assert len(files) > 2 and files == sorted(p.name for p in two.iterdir())
    assert all((one / f).read_bytes() == (two / f).read_bytes() for f in files)
    synthetic.write_part(two, shape, "q_proj", 0, cpu, 0, 1)
    synthetic.write_index(two)
    assert len(HFCheckpoint(two).keys()) == 3 + 4 * shape.layers
    synthetic.delete(two, "q_proj")
    assert sorted(HFCheckpoint(two).keys()) == sorted(n for n, _ in synthetic.part_tensors(shape, "base"))
    assert not list(two.glob("model-q_proj-*"))


def test_a_call_on_a_fresh_machine_runs_again_the_stages_whose_files_the_resume_needs(tmp_path, monkeypatch):
    """Records say prepare and train are done, but this machine has neither the prepared recipe nor the killed run's
    checkpoint (an earlier call ran them on another machine): prepare and train run again before the resume; with
    the files here only the resume runs. The stages are stubbed: what is checked is which ones the call starts."""
    from bench.kinds import chain
    from frod_ds.train.checkpoints import COMPLETE, tag_of

    suite = load_suite(SUITE)
    (cfg,) = suite.configs
    results, work, ran = tmp_path / "results", tmp_path / "work", []

    def stage(name: str, files: bool):
        def run(ch, *args):
            ran.append(name)
            for st in chain.PREPARE if name == "prepare" else (name,):
                ch.write(st, "ok", {}, 1.0, ["stub"])
            if files and name == "prepare":
                (ch.root / "recipe.yaml").write_text("stub")
            if files and name == "train":
                sealed = ch.runs / "train" / "checkpoints" / tag_of(cfg["save_at"]) / COMPLETE
                sealed.parent.mkdir(parents=True)
                sealed.write_text("")
            return "ok", 1.0

        return run

    def calls(files: bool) -> list[str]:
        ran.clear()
        monkeypatch.setattr(chain, "_prepare_stage", stage("prepare", files))
        monkeypatch.setattr(chain, "_train_stage", lambda ch, group, left: stage(group, files)(ch))
        monkeypatch.setattr(chain, "predict", lambda ch: {"mfu_batch": cfg["batch"]})
        chain.run_chain(suite, results, work, budget_s=1e6, only=None, series=1, log=lambda *_: None)
        return list(ran)

    monkeypatch.setitem(cfg.settings, "host_probe", False)
    assert calls(files=False) == ["prepare", "train", "resume", "mfu"]  # a first call
    record_path(results, suite.name, "cpu", cfg.name, 1, "resume").unlink()
    assert calls(files=False) == ["prepare", "train", "resume"]  # a fresh machine: nothing of the first call here
    record_path(results, suite.name, "cpu", cfg.name, 1, "resume").unlink()
    assert calls(files=True) == ["prepare", "train", "resume"]  # (its files written this time)
    record_path(results, suite.name, "cpu", cfg.name, 1, "resume").unlink()
    assert calls(files=True) == ["resume"]  # the same machine again: the files are here
    assert calls(files=True) == []


def _paced_suite(folder: Path) -> Path:
    """The suite as the repository has it, with its configuration time-out at this machine's pace."""
    text = SUITE.read_text()
    assert text.count("\ntimeout_s = 100\n") == 1, "the suite's time-out changed: update this test"
    folder.mkdir()
    path = folder / SUITE.name
    path.write_text(text.replace("\ntimeout_s = 100\n", f"\ntimeout_s = {pace.scaled(100):.0f}\n"))
    return path


@pytest.mark.slow
def test_tiny_chain_generates_decomposes_deletes_trains_kills_and_resumes_bitwise(tmp_path):
    results, work = tmp_path / "results", tmp_path / "work"
    paced = _paced_suite(tmp_path / "suite")
    args = ("run", str(paced), "--results", str(results), "--work", str(work))
    run = _bench(*args)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    suite = load_suite(paced)
    (cfg,) = suite.configs
    s, root = cfg.settings, work / "chain" / cfg.name
    model, store = root / "model", root / "store"

    # every category decomposed, then deleted: the checkpoint holds the untargeted tensors only, the store is complete
    keys = HFCheckpoint(model).keys()
    assert keys and not [k for k in keys if any(f".{c}." in k for c in synthetic.TARGETS)]
    assert sorted(p.name for p in model.glob("*.safetensors")) == ["model-base-0000.safetensors"]
    assert Manifest.read(store / MANIFEST).complete
    check_store_matches(FactorStore.open(store), HFCheckpoint(model))  # what training checked: the other tensors
    # the weights HJD decomposed are the ones the generator regenerates from their names: with q_proj written back
    # (every targeted weight present) the store's fingerprint of all of them must match
    full = tmp_path / "full"
    shutil.copytree(model, full)
    for c in synthetic.TARGETS:
        synthetic.write_part(full, shape_of(s), c, s["seed"], torch.device("cpu"), 0, 1)
    synthetic.write_index(full)
    check_store_matches(FactorStore.open(store), HFCheckpoint(full))
    # ... and each is N(0, 0.02²) drawn from sha256("<seed>:<name>"), computed here without the generator
    name = "model.layers.1.self_attn.q_proj.weight"
    seed = int.from_bytes(hashlib.sha256(f"{s['seed']}:{name}".encode()).digest()[:8], "little") >> 1
    want = torch.randn((64, 64), generator=torch.Generator().manual_seed(seed)).mul_(0.02).to(torch.bfloat16)
    with safe_open(str(full / "model-q_proj-0000.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor(name), want)

    # the killed run and the resumed one, read from the files the runs left
    killed = json.loads((root / "runs" / "train.json").read_text())["rows"]
    resumed = [json.loads(x) for x in (root / "runs" / "train" / "metrics.jsonl").read_text().splitlines()]
    assert s["kill_at"] <= max(r["step"] for r in killed) < s["steps"]  # killed mid-run, after its checkpoint
    # no rank of the killed run lived on to write a later checkpoint: the resume started from save_at's
    assert (
        f"resumed from step{s['save_at']:08d}: step {s['save_at']}/{s['steps']}"
        in (root / "runs" / "resume.log").read_text()
    )
    assert [r["step"] for r in resumed] == list(range(1, s["steps"] + 1))
    overlap = [r for r in killed if r["step"] > s["save_at"]]
    assert overlap and all(
        (r["loss"], r["grad_norm"]) == (resumed[r["step"] - 1]["loss"], resumed[r["step"] - 1]["grad_norm"])
        for r in overlap
    )
    assert [r["loss"] for r in killed[: s["save_at"]]] == [r["loss"] for r in resumed[: s["save_at"]]]

    # one valid record per stage, the prediction written before the training ran
    records = {r.stage: r for r in read_records(results, suite.name, "cpu")}
    assert sorted(records) == sorted(STAGES) and all(r.status == "ok" for r in records.values())
    for r in records.values():
        assert Record.from_json(json.loads(json.dumps(r.__dict__))) == r and r.settings == s
    assert records["predict"].date <= records["train"].date
    assert records["resume"].metrics["compared_steps"] == [r["step"] for r in overlap]
    mfu = records["mfu"].metrics
    pick = records["predict"].metrics["mfu_batch"]
    assert mfu["figures"]["micro_batch"] == pick == s["batch"]  # the planner's pick: the resume run measured it
    for r in (records["resume"], records["mfu"]):  # every example is exactly seq tokens: no padding
        f = r.metrics["figures"]
        assert f["tokens_per_step_per_gpu"] == pytest.approx(f["micro_batch"] * s["seq"], rel=1e-6)
        assert len(f["host_peak_rss_gib_per_rank"]) == s["gpus"]
        phases = [f[f"{k}_median"] for k in ("data_s", "forward_s", "backward_s", "optimizer_s")]  # phase_times
        assert all(t > 0 for t in phases) and sum(phases) <= 1.5 * f["step_s_median"]
    # the profiled step (profile_step): each rank's cProfile summary kept in the train record; its row not timed
    profiles = records["train"].metrics["profiles"]
    assert list(profiles) == ["rank0"] and profiles["rank0"].startswith(f"rank 0, optimizer step {s['profile_step']}:")
    timed = [r["step_time_s"] for r in killed[1:] if r["step"] != s["profile_step"]]
    assert len(timed) == len(killed) - 2 and records["train"].metrics["figures"]["step_s_median"] == median(timed)
    # the host probe (host_probe): bench/host_device.py's tiny step, timed once in this call before training, in
    # every training record of the call, as its own JSON has it
    probe = records["train"].metrics["host_probe"]
    written = json.loads((root / "runs" / "host_probe" / "host_device.json").read_text())["runs"]
    assert [r["name"] for r in written] == ["tiny_none"] and probe["host_step_ms"] == written[0]["host"]["step_ms"] > 0
    assert all(records[st].metrics["host_probe"] == probe for st in ("resume", "mfu"))
    for stage in ("train", "resume"):  # the build time is frod train's own line in that run's log
        said = re.findall(r"model built in ([0-9.]+) s", (root / "runs" / f"{stage}.log").read_text())
        assert said and records[stage].metrics["figures"]["build_s"] == float(said[-1]) > 0
    report = results / suite.name / "cpu" / "report.md"
    assert report.read_text() == render(suite, "cpu", read_records(results, suite.name, "cpu"))
    assert "| run | data s | forward s | backward s | optimizer s |" in report.read_text()  # phase_times

    # a second run finds every stage done and starts nothing; the mfu stage that copies the resume run's figures
    # needs no budget, so with its record gone a call with no budget left still writes it (and nothing else)
    record_path(results, suite.name, "cpu", cfg.name, 1, "mfu").unlink()
    t0 = time.monotonic()
    again = _bench(*args, "--budget-s", "0")
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    said = {line.split()[0]: line.split()[-1] for line in again.stdout.splitlines() if line.startswith(cfg.name)}
    assert said.pop(f"{cfg.name}.mfu") == "ok" and set(said.values()) == {"done"}, again.stdout
    now = {r.stage: r for r in read_records(results, suite.name, "cpu")}
    assert {k: r.call for k, r in now.items() if k != "mfu"} == {k: r.call for k, r in records.items() if k != "mfu"}
    assert now["mfu"].status == "ok" and now["mfu"].metrics["same_run_as"] == "resume"
    assert now["mfu"].metrics["figures"] == records["resume"].metrics["figures"]
    assert time.monotonic() - t0 < pace.scaled(30)
