"""A run directory written by frod-ds before the package was split by stage (``tests/fixtures/run_v1``, made by
``tests/fixtures/make_run_v1.py`` with that code: stopped after its sealed step-3 checkpoint) resumes with
today's code, and steps 4-6 give the losses the original code logged when it ran the same 6 steps
uninterrupted (``expected_losses.json``, written by the original code)."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest

from tests.support.leftovers import REPO
from tests.support.train_env import CPU_ZERO2, metrics, run_train

FIX = REPO / "tests" / "fixtures" / "run_v1"


def _maker():
    spec = importlib.util.spec_from_file_location("make_run_v1", REPO / "tests" / "fixtures" / "make_run_v1.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _resume(tmp_path, fixture: str, config, nproc: int):
    """Copy ``tests/fixtures/<fixture>``, train on with today's code; (output, metrics rows, expected losses, maker)."""
    root = tmp_path / fixture
    shutil.copytree(REPO / "tests" / "fixtures" / fixture, root)
    expected = {int(k): v for k, v in json.loads((root / "expected_losses.json").read_text()).items()}
    make = _maker()
    res = run_train(config, [f"{k}={v}" for k, v in make.run_overrides(root).items()], nproc=nproc)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = metrics(root / "run")
    assert [r["step"] for r in rows] == list(range(1, make.STEPS + 1))
    for r in rows[make.SAVE_AT :]:  # computed now, from the old checkpoint
        assert r["loss"] == pytest.approx(expected[r["step"]], rel=1e-6, abs=1e-6), r["step"]
    return res.stdout + res.stderr, rows, expected, make


@pytest.mark.slow
def test_run_written_before_the_move_resumes_with_the_original_losses(tmp_path):
    out, rows, expected, make = _resume(tmp_path, FIX.name, CPU_ZERO2, nproc=0)
    assert "resumed from" in out
    # written while ZeRO-2 held σ and S per FRoD layer: back through the trainable-state record
    assert "from σ and S held per FRoD layer to per decoder layer" in out
    assert {r["step"]: r["loss"] for r in rows[: make.SAVE_AT]} == {s: expected[s] for s in range(1, make.SAVE_AT + 1)}
    assert (tmp_path / FIX.name / "run" / "adapter-final" / "adapter.safetensors").is_file()


@pytest.mark.slow
def test_zero3_run_with_sigma_and_s_per_frod_layer_resumes_with_them_per_decoder_layer(tmp_path):
    """``tests/fixtures/run_zero3_v2`` (``make_run_zero3.py``, 2 ranks, ZeRO-3, written while every FRoD layer held
    its own σ and S Parameters) resumes on the same 2 ranks under the same JSON, where ZeRO-3 now holds σ and S per
    decoder layer: DeepSpeed's own files cannot load into the new Parameters, so the run comes back through the
    trainable-state record, and steps 4-6 give the losses the old code logged uninterrupted."""
    from tests.support.train_env import CPU_ZERO3

    out, _, _, _ = _resume(tmp_path, "run_zero3_v2", CPU_ZERO3, nproc=2)
    assert "from σ and S held per FRoD layer to per decoder layer" in out
