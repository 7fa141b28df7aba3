"""``DS_ACCELERATOR`` (DeepSpeed's choice of device kind) set to something DeepSpeed cannot use: a name it does
not know, ``cuda`` without a visible GPU, a kind whose support package is missing. ``frod train`` refuses it in
one line naming the variable, before DeepSpeed starts and before anything is written; unset, empty or ``cpu`` run.
Each case is its own process: DeepSpeed resolves the variable once, when it is first imported."""

from __future__ import annotations

import subprocess
import sys

import pytest

from frod_ds.runtime.deepspeed_state import accelerator_problem
from tests.support.leftovers import REPO, clean_env
from tests.support.train_env import CPU_ZERO3, build_env


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return build_env(tmp_path_factory.mktemp("trainenv"))


def _train(env, out, value: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "frod_ds", "train", "--config", str(CPU_ZERO3)]
    argv += env.overrides(out, **{"train.max_steps": 1})
    return subprocess.run(
        argv, cwd=REPO, capture_output=True, text=True, timeout=240, env=clean_env(DS_ACCELERATOR=value)
    )


@pytest.mark.parametrize(
    "value, says",
    [
        ("bogus", "DS_ACCELERATOR='bogus' names no accelerator DeepSpeed knows (cuda, cpu"),
        ("cuda", "DS_ACCELERATOR=cuda but this process sees no CUDA GPU"),
        ("npu", "DS_ACCELERATOR='npu': DeepSpeed cannot use it (NPU_Accelerator requires torch_npu"),
    ],
)
def test_a_ds_accelerator_deepspeed_cannot_use_is_one_line(env, tmp_path, value, says):
    out = tmp_path / "run"
    res = _train(env, out, value)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    lines = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, res.stderr[-3000:]
    assert says in lines[0], lines[0]
    assert lines[0].endswith("unset it (DeepSpeed then finds the device itself) or set DS_ACCELERATOR=cpu")
    assert not out.exists(), "nothing written"


def test_an_empty_ds_accelerator_is_taken_as_unset(env, tmp_path):
    """An empty value trains; its adapter then exports, and an export under a name DeepSpeed does not know is
    refused in one line before anything is written (transformers' save_pretrained imports DeepSpeed)."""
    out = tmp_path / "run"
    res = _train(env, out, "")
    assert res.returncode == 0, res.stderr[-3000:]
    assert (out / "adapter-final").is_dir()
    ex = tmp_path / "ex"
    argv = [sys.executable, "-m", "frod_ds", "export", "--checkpoint", str(out / "adapter-final"), "--out", str(ex)]
    argv += ["--device", "cpu"]
    res = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=240, env=clean_env(DS_ACCELERATOR="x"))
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-3000:]
    assert lines[0].startswith("error: DS_ACCELERATOR='x' names no accelerator") and not ex.exists(), lines


@pytest.mark.parametrize("value", [None, "", "cpu"])
def test_usable_values_are_no_problem(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    else:
        monkeypatch.setenv("DS_ACCELERATOR", value)
    assert accelerator_problem() is None


def test_convert_gguf_refuses_an_unknown_ds_accelerator_before_converting(tmp_path):
    """transformers' save_pretrained imports DeepSpeed, which would raise on the value after the model is loaded."""
    from tests.support.realmodel import RealModelUnavailable, locate_gguf

    try:
        gguf = locate_gguf(download=False)
    except RealModelUnavailable as e:
        pytest.skip(str(e))
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "frod_ds", "convert-gguf", "convert", "--gguf", str(gguf), "--out", str(out)]
    res = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=240, env=clean_env(DS_ACCELERATOR="x"))
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: DS_ACCELERATOR='x' names no accelerator"), lines
    assert not out.exists() and list(tmp_path.iterdir()) == []
