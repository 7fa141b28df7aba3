"""bench/planner_check.py: the memory planner's prediction for a recorded step, and the runs it does not model."""

from __future__ import annotations

import pytest


def test_planner_check_plans_the_recorded_run_and_skips_what_the_planner_does_not_model():
    from bench.planner_check import check
    from frod_ds.plan.memory import plan_memory
    from frod_ds.plan.shapes import GiB, TrainShape, engine_from_ds_config, model_shape_from_config

    model = {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
    }
    ds = {"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 10}}
    run = {
        "method": "frod",
        "ds_config": ds,
        "config": "x/zero3.json",
        "peak_allocated_gib": 1.0,
        "model": model,
        "frod": {"sparsity": 0.05, "impl": "autograd"},
        "micro_batch": 3,
        "seq_len": 16,
        "targets": ["q_proj", "v_proj"],
        "gradient_checkpointing": True,
        "world_size": 2,
        "device": "d",
        "_file": "f.json",
        "frozen_quant": "nf4",
    }
    got = check(run)
    want = plan_memory(
        model_shape_from_config({"model_type": "llama", **model}),
        TrainShape(3, 16, "bfloat16", ("q_proj", "v_proj"), 0.05, "nf4", False, True, "M"),
        engine_from_ds_config(ds),
        2,
        140 * GiB,
    )
    assert got["predicted_gib"] == pytest.approx(want.allocated / GiB)
    assert got["error"] == pytest.approx(want.allocated / GiB - 1.0)
    assert check({**run, "method": "lora"}) is None and check({**run, "ds_config": None}) is None
