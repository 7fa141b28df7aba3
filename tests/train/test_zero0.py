"""ZeRO stage 0 (DeepSpeed's plain data parallel, ``ds_configs/zero0.json``) end to end on CPU, fp32, 2 ranks: it
trains step by step like ZeRO-2 (the same math, another engine), saves, and resumes from its checkpoint on the same
2 ranks (DeepSpeed's own files: bitwise) and on 1 rank (the trainable-state record: the uninterrupted run's losses
within 1e-6). Before, the first save stopped the run with a message about world sizes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.train_env import CPU_ZERO2, REPO, build_env, metrics, run_train

pytestmark = pytest.mark.slow

STEPS, SAVED = 4, 2
COMMON = {"train.max_steps": STEPS, "train.save_every": SAVED, "train.keep_checkpoints": 3, "train.micro_batch_size": 2}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return build_env(tmp_path_factory.mktemp("zero0"))


@pytest.fixture(scope="module")
def cpu_zero0(env) -> Path:
    """The shipped zero0.json in fp32 (bf16 off), as zero2_cpu_fp32.json is zero2.json."""
    cfg = json.loads((REPO / "ds_configs" / "zero0.json").read_text())
    assert cfg["zero_optimization"] == {"stage": 0}
    cfg["bf16"] = {"enabled": False}
    path = env.root / "zero0_cpu_fp32.json"
    path.write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def ref(env, cpu_zero0):
    """An uninterrupted 2-rank stage-0 run, checkpoints at steps 2 and 4."""
    out = env.root / "ref"
    res = run_train(cpu_zero0, env.overrides(out, **COMMON, **{"train.grad_accum": 2}), nproc=2)
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").glob("step*")) == ["step00000002", "step00000004"]
    return out


def _adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "adapter-final" / "adapter.safetensors"))


def test_zero0_trains_like_zero2_step_by_step(env, ref, tmp_path):
    res = run_train(CPU_ZERO2, env.overrides(tmp_path / "z2", **COMMON, **{"train.grad_accum": 2}), nproc=2)
    assert res.returncode == 0, res.stderr[-3000:]
    z0, z2 = metrics(ref), metrics(tmp_path / "z2")
    assert [r["step"] for r in z0] == [r["step"] for r in z2] == list(range(1, STEPS + 1))
    for a, b in zip(z0, z2):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (a, b)  # logged, not NaN
    want, got = _adapter(tmp_path / "z2"), _adapter(ref)
    assert want.keys() == got.keys()
    for k, v in want.items():
        assert torch.allclose(got[k], v, rtol=1e-5, atol=1e-6), k


def _stopped_at_step2(ref: Path, out: Path) -> Path:
    shutil.copytree(ref, out)
    shutil.rmtree(out / "checkpoints" / f"step{STEPS:08d}")
    shutil.rmtree(out / "adapter-final")
    (out / "checkpoints" / "latest_complete").write_text(f"step{SAVED:08d}")
    return out


@pytest.mark.parametrize("nproc, accum", [(2, 2), (1, 4)], ids=["same-2-ranks", "on-1-rank"])
def test_zero0_resumes_its_checkpoint(env, ref, cpu_zero0, tmp_path, nproc, accum):
    out = _stopped_at_step2(ref, tmp_path / "run")
    res = run_train(cpu_zero0, env.overrides(out, **COMMON, **{"train.grad_accum": accum}), nproc=nproc)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"resumed from step{SAVED:08d}: step {SAVED}/{STEPS}" in res.stdout + res.stderr
    elastic = [x for x in res.stderr.splitlines() if x.startswith("note: resumed from 2 ranks")]
    assert len(elastic) == (nproc != 2), res.stderr[-3000:]
    want, got = metrics(ref), metrics(out)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    want_adapter, adapter = _adapter(ref), _adapter(out)
    if nproc == 2:  # DeepSpeed's own files, on the layout that wrote them
        assert [r["loss"] for r in got] == [r["loss"] for r in want]
        assert all(torch.equal(adapter[k], v) for k, v in want_adapter.items())
    else:
        for a, b in zip(got, want):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-6), (a, b)
        for k, v in want_adapter.items():
            assert (adapter[k] - v).abs().max() <= 1e-5 * v.abs().max(), k


def test_a_zero0_run_continues_under_zero2(env, ref, tmp_path):
    """The ZeRO layout is not the run: stage 0's checkpoint (σ and S per FRoD layer) continues under ZeRO-2 (per
    decoder layer) through the trainable-state record, with the uninterrupted stage-0 run's losses."""
    out = _stopped_at_step2(ref, tmp_path / "run")
    res = run_train(CPU_ZERO2, env.overrides(out, **COMMON, **{"train.grad_accum": 2}), nproc=2)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "from ZeRO-0 on ZeRO-2" in res.stderr, res.stderr[-3000:]
    for a, b in zip(metrics(out), metrics(ref)):
        assert a["step"] == b["step"] and a["loss"] == pytest.approx(b["loss"], rel=1e-6), (a, b)
