"""Ranks started with different settings (nodes reading different recipe copies, or different data files) are
refused before the model is built, on every rank, in one line naming what differs; ranks started alike train."""

from __future__ import annotations

import pytest

from tests.support.train_env import REPO, build_env, run_train

CPU_ZERO2 = REPO / "ds_configs" / "zero2_cpu_fp32.json"
SCRIPT = REPO / "tests" / "support" / "rank_args.py"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return build_env(tmp_path_factory.mktemp("agree") / "env")


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        ("train.lr_sigma=0.1", "train.lr_sigma: 0.01 on rank 0, 0.1 on rank 1"),
        ("model.sparsity=0.2", "model.sparsity: 0.1 on rank 0, 0.2 on rank 1"),
    ],
)
def test_ranks_started_with_different_settings_are_refused(env, tmp_path, monkeypatch, extra, said):
    monkeypatch.setenv("RANK1_EXTRA", extra)
    out = tmp_path / "out"
    res = run_train(CPU_ZERO2, env.overrides(out, **{"train.max_steps": 1}), nproc=2, script=SCRIPT)
    assert res.returncode == 2, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if "error:" in line]
    assert errors and all("the ranks were not started alike" in e for e in errors), res.stderr[-3000:]
    assert said in errors[0] and "Traceback" not in res.stderr
    assert not (out / "adapter-final").exists()
