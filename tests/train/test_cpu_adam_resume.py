"""A resume under an offloaded optimizer (DeepSpeedCPUAdam) continues the uninterrupted run bit for bit: the C++
optimizer's β-power products are replayed to the restored step (``replay_cpu_adam_steps``)."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from frod_ds.train.trainable_state import replay_cpu_adam_steps


class _Op:
    """Records what DeepSpeedCPUAdam's C++ op is asked to do."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def adam_update(self, opt_id, step, lr, b1, b2, eps, wd, bias_correction, *tensors) -> None:
        assert all(t.numel() == 1 for t in tensors)  # scratch, never the model's tensors
        self.calls.append((opt_id, step, lr, b1, b2, wd))


class DeepSpeedCPUAdam(torch.optim.Optimizer):  # the name is what the replay keys on
    def __init__(self, groups, step) -> None:
        super().__init__(groups, {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8})
        self.opt_id, self.ds_opt_adam = 7, _Op()
        for g in self.param_groups:
            for p in g["params"]:
                self.state[p]["step"] = step


def test_the_replay_steps_each_group_once_per_restored_step_with_its_betas():
    a, b = torch.zeros(3), torch.zeros(2)
    opt = DeepSpeedCPUAdam([{"params": [a]}, {"params": [b], "betas": (0.8, 0.99)}], step=3)
    replay_cpu_adam_steps(SimpleNamespace(optimizer=SimpleNamespace(optimizer=opt)))  # as ZeRO wraps it
    assert opt.ds_opt_adam.calls == [
        (7, s, 0.0, *betas, 0.0) for s in (1, 2, 3) for betas in ((0.9, 0.999), (0.8, 0.99))
    ]
    assert torch.equal(a, torch.zeros(3)) and torch.equal(b, torch.zeros(2))

    fresh = DeepSpeedCPUAdam([{"params": [torch.zeros(1)]}], step=0)
    replay_cpu_adam_steps(SimpleNamespace(optimizer=fresh))
    assert fresh.ds_opt_adam.calls == []


def test_other_optimizers_are_left_alone():
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([p])
    p.grad = torch.ones(2)
    opt.step()
    before = copy.deepcopy(opt.state_dict())
    replay_cpu_adam_steps(SimpleNamespace(optimizer=opt))
    assert str(opt.state_dict()) == str(before)


def _built_cpu_adam() -> Path | None:
    """The cached ``cpu_adam`` build, if this machine has one: building it takes minutes (four on two cores)."""
    from torch.utils.cpp_extension import _get_build_directory

    so = Path(_get_build_directory("cpu_adam", verbose=False)) / "cpu_adam.so"
    return so if so.is_file() else None


@pytest.mark.slow
@pytest.mark.skipif(
    _built_cpu_adam() is None,
    reason="DeepSpeed's cpu_adam op is not built here (its build takes minutes, past a test's time); "
    "a frod train run with offload_optimizer and zero_force_ds_cpu_optimizer builds it",
)
def test_frod_train_under_an_offloaded_optimizer_resumes_bitwise(tmp_path):
    """ZeRO-2 with DeepSpeedCPUAdam on 2 ranks, stopped after its step-5 checkpoint: the resumed run's losses and
    gradient norms are the uninterrupted run's, exactly (without the replay, steps 7 and 8 differ)."""
    from tests.support.train_env import CPU_ZERO2, build_env, metrics, run_train

    cfg = json.loads(CPU_ZERO2.read_text())
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    cfg["zero_force_ds_cpu_optimizer"] = True
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    env = build_env(tmp_path / "env")
    common = {"train.max_steps": 8, "train.save_every": 5, "train.micro_batch_size": 2, "train.grad_accum": 2}
    ref, out = tmp_path / "ref", tmp_path / "resumed"
    res = run_train(tmp_path / "ds.json", env.overrides(ref, **common), nproc=2)
    assert res.returncode == 0, res.stderr[-3000:]
    shutil.copytree(ref, out)
    shutil.rmtree(out / "checkpoints" / "step00000008")
    shutil.rmtree(out / "adapter-final")
    (out / "checkpoints" / "latest_complete").write_text("step00000005")
    res = run_train(tmp_path / "ds.json", env.overrides(out, **common), nproc=2)
    assert res.returncode == 0, res.stderr[-3000:]
    want, got = ({r["step"]: (r["loss"], r["grad_norm"]) for r in metrics(d)} for d in (ref, out))
    assert [got[s] for s in (6, 7, 8)] == [want[s] for s in (6, 7, 8)]
