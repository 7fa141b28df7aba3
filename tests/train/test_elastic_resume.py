"""Resume on another world size (CPU, gloo, fp32): a run started on 2 ranks (micro 2 x accum 2) continues from
its step-3 checkpoint on 1 rank (2 x 4) and on 4 ranks (2 x 1) — the same global batch of 8 — and gives the
uninterrupted 2-rank run's per-step losses (within 1e-6 relative) and final σ/S, under ZeRO-2 and ZeRO-3."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.train_env import CPU_ZERO2, CPU_ZERO3, build_env, metrics, run_train

pytestmark = pytest.mark.slow

STEPS, SAVED = 6, 3
COMMON = {
    "train.max_steps": STEPS,
    "train.save_every": SAVED,
    "train.keep_checkpoints": 3,
    "train.warmup_ratio": 0.25,
    "train.schedule": "cosine",
    "train.micro_batch_size": 2,
}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return build_env(tmp_path_factory.mktemp("elastic"))


def _stopped_at_step3(ref: Path, out: Path) -> Path:
    """``ref``'s output dir as the run left it after its step-3 checkpoint: later checkpoints and adapters gone."""
    shutil.copytree(ref, out)
    shutil.rmtree(out / "checkpoints" / f"step{STEPS:08d}")
    shutil.rmtree(out / "adapter-final")
    (out / "checkpoints" / "latest_complete").write_text(f"step{SAVED:08d}")
    return out


def _adapter(out: Path) -> dict[str, torch.Tensor]:
    return {
        k: v
        for k, v in load_file(str(out / "adapter-final" / "adapter.safetensors")).items()
        if not k.endswith(".support")
    }


@pytest.mark.parametrize("config", [CPU_ZERO2, CPU_ZERO3], ids=["zero2", "zero3"])
def test_resume_on_one_and_four_ranks_continues_the_two_rank_run(env, tmp_path, config):
    ref = tmp_path / "ref"
    res = run_train(config, env.overrides(ref, **COMMON, **{"train.grad_accum": 2}), nproc=2)
    assert res.returncode == 0, res.stderr[-3000:]
    want = {r["step"]: r["loss"] for r in metrics(ref)}
    assert sorted(want) == list(range(1, STEPS + 1))
    want_adapter = _adapter(ref)

    for nproc, accum in ((1, 4), (4, 1)):
        out = _stopped_at_step3(ref, tmp_path / f"on{nproc}")
        res = run_train(config, env.overrides(out, **COMMON, **{"train.grad_accum": accum}), nproc=nproc)
        assert res.returncode == 0, res.stderr[-3000:]
        notes = [x for x in res.stderr.splitlines() if x.startswith("note: resumed from")]
        assert notes == [
            f"note: resumed from 2 ranks on {nproc} (same global batch 8) from "
            f"step{SAVED:08d}/trainable_state.safetensors"
        ], res.stderr[-3000:]
        got = {r["step"]: r["loss"] for r in metrics(out)}
        assert sorted(got) == list(range(1, STEPS + 1)), "replayed rows dropped, one row per step"
        for step in range(SAVED + 1, STEPS + 1):
            assert got[step] == pytest.approx(want[step], rel=1e-6), (nproc, step, got[step], want[step])
        adapter = _adapter(out)
        assert adapter.keys() == want_adapter.keys()
        for k, v in want_adapter.items():
            assert (adapter[k] - v).abs().max() <= 1e-5 * v.abs().max(), (nproc, k)
    if config == CPU_ZERO2:  # the same ranks, another split of the global batch: DeepSpeed's own files, and a note
        out = _stopped_at_step3(ref, tmp_path / "micro1")
        split = {**COMMON, "train.micro_batch_size": 1, "train.grad_accum": 4}
        res = run_train(config, env.overrides(out, **split), nproc=2)
        assert res.returncode == 0, res.stderr[-3000:]
        notes = [x for x in res.stderr.splitlines() if x.startswith("note: resumed from")]
        assert notes == [
            f"note: resumed from step{SAVED:08d}; micro_batch_size 2 -> 1 weights each micro-batch's tokens "
            "differently, so losses are close to, not equal to, the original layout's (train.micro_batch_size=2 "
            "continues it exactly)"
        ], res.stderr[-3000:]
        assert sorted(r["step"] for r in metrics(out)) == list(range(1, STEPS + 1))


def _continues_under(env, tmp_path, first: tuple, then: tuple, change: str) -> None:
    """A run of ``first`` (DeepSpeed JSON, overrides) continues from its step-3 checkpoint under ``then`` on the
    same 2 ranks, naming ``change`` in its note, with the uninterrupted run's losses (1e-6) and adapter."""
    ref = tmp_path / "ref"
    res = run_train(first[0], env.overrides(ref, **COMMON, **first[1]), nproc=2)
    assert res.returncode == 0, res.stderr[-3000:]
    want = {r["step"]: r["loss"] for r in metrics(ref)}
    out = _stopped_at_step3(ref, tmp_path / "continued")
    res = run_train(then[0], env.overrides(out, **COMMON, **then[1]), nproc=2)
    assert res.returncode == 0, res.stderr[-3000:]
    notes = [x for x in res.stderr.splitlines() if x.startswith("note: resumed from")]
    assert notes == [
        f"note: resumed from {change} (same global batch 8) from step{SAVED:08d}/trainable_state.safetensors"
    ], res.stderr[-3000:]
    got = {r["step"]: r["loss"] for r in metrics(out)}
    for step in range(SAVED + 1, STEPS + 1):
        assert got[step] == pytest.approx(want[step], rel=1e-6), (step, got[step], want[step])
    want_adapter, adapter = _adapter(ref), _adapter(out)
    assert adapter.keys() == want_adapter.keys()
    for k, v in want_adapter.items():
        assert (adapter[k] - v).abs().max() <= 1e-5 * v.abs().max(), k


ACCUM = {"train.grad_accum": 2}
DEEPSPEED = {**ACCUM, "train.zero3_partition": "deepspeed"}


def test_zero2_run_continues_under_zero3(env, tmp_path):
    """A ZeRO-2 run continues from its step-3 checkpoint under DeepSpeed's ZeRO-3 (both hold σ and S per decoder layer,
    ``FRoDTrainables``, but in DeepSpeed files of another stage): through the trainable-state record, with the
    uninterrupted run's losses (1e-6 relative) and adapter. A checkpoint with σ and S per FRoD layer coming back
    per decoder layer: ``tests/train/test_resume_fixture.py``."""
    _continues_under(env, tmp_path, (CPU_ZERO2, ACCUM), (CPU_ZERO3, DEEPSPEED), "ZeRO-2 on ZeRO-3")


def test_deepspeed_zero3_run_continues_under_the_layer_partition(env, tmp_path):
    """A checkpoint of a ``zero3.json`` run under DeepSpeed's own stage 3 (``train.zero3_partition=deepspeed``, what
    ``zero3.json`` ran before the layer partition) continues under the layer partition ``zero3.json`` now gets:
    through the trainable-state record, with the uninterrupted run's losses (1e-6 relative) and adapter."""
    change = "ZeRO-3 on ZeRO-3 by decoder layer"
    _continues_under(env, tmp_path, (CPU_ZERO3, DEEPSPEED), (CPU_ZERO3, ACCUM), change)
