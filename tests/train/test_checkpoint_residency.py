"""Gradient checkpointing under ZeRO-3 (CPU, gloo, 2 ranks, an 8-layer tiny LLaMA): the trainer's checkpointing keeps
about one decoder layer of frozen parameters gathered at a time, and leaves losses, gradients and updates unchanged.

tests/support/residency_probe.py runs every mode in one launch and samples, after each of DeepSpeed's fetches, the
frozen elements gathered. The DeepSpeed JSON is the CPU ZeRO-3 one without prefetching, reuse window or persistent
parameters, so that what stays gathered is what the checkpointing leaves there: with the project's
``stage3_param_persistence_threshold`` every parameter of a model this small is persistent (never released), and
1e9-element prefetch and reuse windows reach across the whole model.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.train_env import CPU_ZERO3, REPO, build_env, run_train

pytestmark = pytest.mark.slow
PROBE = REPO / "tests" / "support" / "residency_probe.py"
LAYERS = 8
MODES = ("plain", "trainer", "trainer-call", "reentrant-call")
BOUND_LAYERS = 2.5  # the trainer's checkpointing must hold fewer than this many layers' frozen elements


@pytest.fixture(scope="module")
def residency(tmp_path_factory):
    root = tmp_path_factory.mktemp("residency")
    env = build_env(root / "env", layers=LAYERS)
    cfg = json.loads(CPU_ZERO3.read_text())
    cfg["zero_optimization"].update(
        stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0
    )
    config = root / "zero3_no_prefetch.json"
    config.write_text(json.dumps(cfg))
    out = root / "out"
    steps = {"train.schedule": "constant", "train.warmup_ratio": 0.0, "train.max_steps": 2}
    overrides = env.overrides(out, **steps, **{"train.zero3_partition": "deepspeed"})  # DeepSpeed's gathers
    res = run_train(config, overrides + ["--modes", ",".join(MODES), "--steps", "2"], script=PROBE)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    reports = [json.loads((out / f"residency_rank{r}.json").read_text()) for r in (0, 1)]
    return reports, {m: torch.load(out / f"trainable_{m}.pt") for m in MODES}


def test_trainer_checkpointing_gathers_about_one_layer_of_frozen_parameters(residency):
    """Whether the layer's own hooks are inside its checkpoint (transformers 5.17) or outside (5.23), at most one
    layer's frozen parameters plus the shared Vs (once) are gathered at a time, as without checkpointing."""
    reports, _ = residency
    for rep in reports:
        sizes = rep["plain"]["sizes"]
        assert sizes["layers"] == LAYERS
        bound = BOUND_LAYERS * sizes["layer_own"]
        for mode in ("trainer", "trainer-call"):
            peak = max(rep[mode]["max_gathered"])
            assert peak < bound, (
                f"{mode}: {peak} frozen elements gathered at once, more than {BOUND_LAYERS} layers "
                f"({bound:.0f}); the whole frozen model is {sizes['total']}",
                rep[mode],
            )
            assert max(rep[mode]["max_available"]) <= peak
        assert max(rep["plain"]["max_gathered"]) < bound


def test_reentrant_checkpointing_of_whole_layers_keeps_every_layer_gathered(residency):
    """The counter-example the bound catches: a reentrant recompute, with the layer's hooks inside the checkpoint,
    charges what it gathers to the model around the layers, and every layer stays gathered until the step ends."""
    reports, _ = residency
    for rep in reports:
        sizes = rep["plain"]["sizes"]
        assert min(rep["reentrant-call"]["max_gathered"]) >= LAYERS * sizes["layer_own"] + sizes["shared"]


def test_checkpointing_leaves_losses_gradients_and_updates_unchanged(residency):
    """Two optimizer steps (four micro-batches) with checkpointing: the same losses, gradient norms and σ/S as
    without it, within fp32 rounding."""
    reports, trained = residency
    plain = reports[0]["plain"]
    for mode in MODES[1:]:
        got = reports[0][mode]
        assert got["loss"] == pytest.approx(plain["loss"], rel=1e-6, abs=1e-7), mode
        assert got["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5), mode
        assert all(g > 0 for g in got["grad_norm"])
        assert trained[mode].keys() == trained["plain"].keys()
        for name, value in trained[mode].items():
            torch.testing.assert_close(value, trained["plain"][name], rtol=1e-5, atol=1e-7, msg=f"{mode}: {name}")
    assert reports[1]["plain"]["loss"] == plain["loss"], "ranks log the same (all-reduced) loss"
    assert plain["loss"][1] < plain["loss"][0], "the first step changed σ/S"
