"""Under ZeRO-1/2 the trainer holds σ and S per decoder layer (``FRoDTrainables``: two trainable Parameters per
layer instead of two per FRoD layer, so DeepSpeed's per-tensor host work runs a sixth as often). ZeRO-2's numerics
must not change with it: the same run with one σ and one S Parameter per FRoD layer (the layout before, built by
``build_frod_model(..., flat_trainables=False)``) gives the same losses, gradient norms and trained σ and S, bit for
bit, with gradient clipping active (the norm is where the grouping could show: DeepSpeed sums per-tensor norms,
in fp64) — on 2 ranks in fp32 and on one in bf16 (the shipped ``zero2.json``)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.leftovers import REPO
from tests.support.train_env import CPU_ZERO2, build_env, run_train

pytestmark = pytest.mark.slow
PROBE = REPO / "tests" / "support" / "trainables_layout_probe.py"
STEPS = 4
CLIP = 0.05  # below every step's gradient norm here, so every update is clipped


@pytest.mark.parametrize(
    "config,dtype,nproc",
    [(CPU_ZERO2, "float32", 2), (REPO / "ds_configs" / "zero2.json", "bfloat16", 1)],
    ids=["fp32-2-ranks", "bf16-shipped-1-rank"],
)
def test_zero2_trains_bit_for_bit_as_with_sigma_and_s_per_frod_layer(tmp_path, config, dtype, nproc):
    assert json.loads(config.read_text())["zero_optimization"]["stage"] == 2
    env = build_env(tmp_path / "env")
    out = tmp_path / "out"
    overrides = env.overrides(
        out,
        **{
            "model.dtype": dtype,
            "train.max_grad_norm": CLIP,
            "train.max_steps": STEPS,
            "train.schedule": "constant",
            "train.warmup_ratio": 0.0,
        },
    )
    res = run_train(config, overrides + ["--steps", str(STEPS)], nproc=nproc, script=PROBE)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    new, old = (torch.load(out / f"layout_{m}.pt") for m in ("decoder-layer", "frod-layer"))
    # the layouts differ as intended: two trainable Parameters per decoder layer against two per FRoD layer
    assert all(".frod_flat." in n for n in new["params"]) and len(new["params"]) == 2 * 2  # 2 decoder layers
    assert not any(".frod_flat." in n for n in old["params"]) and len(old["params"]) == len(old["values"])
    assert len(new["loss"]) == STEPS and all(g > CLIP for g in old["grad_norm"])
    assert new["loss"] == old["loss"] and new["grad_norm"] == old["grad_norm"]
    assert new["values"].keys() == old["values"].keys()
    for k, v in old["values"].items():
        assert torch.equal(new["values"][k], v), k
    s_values = [k for k in old["values"] if k.endswith("frod_s")]
    assert s_values and all(bool(old["values"][k].ne(0).any()) for k in s_values)  # S moved from zero: it trained
