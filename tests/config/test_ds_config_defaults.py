"""The one reader of the DeepSpeed JSON against DeepSpeed itself: ``ds_config.DS_DEFAULTS`` is what the installed
DeepSpeed fills in for an absent key, ``zero_settings`` reads a JSON the way DeepSpeed's config classes do, and
the planner's ``Engine`` is built from that reading."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from frod_ds.config.ds_config import DS_DEFAULTS, DSConfigError, bf16_overflow_check, offload_device, zero_settings
from frod_ds.plan.shapes import Engine, engine_from_ds_config

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "ds_configs").glob("*.json"))

zero_config = pytest.importorskip("deepspeed.runtime.zero.config")
offload_config = pytest.importorskip("deepspeed.runtime.zero.offload_config")


def _by_json_name(model) -> dict[str, object]:
    """A DeepSpeed pydantic config object's values under the names its JSON uses (aliases such as stage3_*)."""
    return {(f.alias or name): getattr(model, name) for name, f in type(model).model_fields.items()}


def test_defaults_table_is_deepspeeds_own():
    """Every entry of DS_DEFAULTS equals the default the installed DeepSpeed's config classes give that key."""
    from deepspeed.runtime import precision_config
    from deepspeed.runtime.swap_tensor.aio_config import get_aio_config

    theirs = {
        "zero_optimization": _by_json_name(zero_config.DeepSpeedZeroConfig()),
        "zero_optimization.offload_param": _by_json_name(offload_config.DeepSpeedZeroOffloadParamConfig()),
        "aio": get_aio_config({}),
        "bf16": _by_json_name(precision_config.DeepSpeedBF16Config()),
    }
    for block, table in DS_DEFAULTS.items():
        for key, ours in table.items():
            assert key in theirs[block], f"DeepSpeed has no {block}.{key}"
            assert theirs[block][key] == ours, (
                f"{block}.{key}: DeepSpeed's default {theirs[block][key]!r}, ours {ours!r}"
            )


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_absent_overlap_comm_follows_deepspeeds_stage_rule(stage):
    assert (
        zero_settings({"zero_optimization": {"stage": stage}}).overlap_comm
        == zero_config.DeepSpeedZeroConfig(stage=stage).overlap_comm
    )


def _device(block) -> str | None:
    """DeepSpeed's offload block's device as ``offload_device`` names it (its enum keeps a plain str for some)."""
    device = None if block is None else str(getattr(block.device, "value", block.device))
    return None if device == "none" else device


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_zero_settings_read_every_shipped_json_as_deepspeed_does(path):
    """Each shipped JSON through DeepSpeed's own ZeRO config class and through ``zero_settings``: same values."""
    cfg = json.loads(path.read_text())
    ds = zero_config.DeepSpeedZeroConfig(**cfg["zero_optimization"])
    ours = zero_settings(cfg)
    assert (
        ours.stage,
        ours.overlap_comm,
        ours.reduce_bucket_size,
        ours.allgather_bucket_size,
        ours.prefetch_bucket_size,
        ours.param_persistence_threshold,
        ours.max_live_parameters,
        ours.max_reuse_distance,
        ours.memory_efficient_linear,
    ) == (
        int(ds.stage),
        ds.overlap_comm,
        ds.reduce_bucket_size,
        ds.allgather_bucket_size,
        ds.prefetch_bucket_size,
        ds.param_persistence_threshold,
        ds.max_live_parameters,
        ds.max_reuse_distance,
        ds.memory_efficient_linear,
    )
    assert (ours.offload_param, ours.offload_optimizer) == (_device(ds.offload_param), _device(ds.offload_optimizer))
    param = ds.offload_param or offload_config.DeepSpeedZeroOffloadParamConfig()
    assert (ours.nvme_buffer_count, ours.nvme_buffer_size, ours.max_in_cpu) == (
        param.buffer_count,
        param.buffer_size,
        param.max_in_cpu,
    )


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_planner_engine_is_the_ds_config_reading(path):
    cfg = json.loads(path.read_text())
    z, e = zero_settings(cfg), engine_from_ds_config(cfg, path.name)
    assert (
        e.stage,
        e.offload_param,
        e.offload_optimizer,
        e.reduce_bucket,
        e.prefetch_bucket,
        e.persistence,
        e.max_live,
        e.max_reuse,
        e.memory_efficient_linear,
    ) == (
        3 if z.stage == 3 else 2,
        z.offload_param is not None,
        z.offload_optimizer is not None,
        z.reduce_bucket_size,
        z.prefetch_bucket_size,
        z.param_persistence_threshold,
        z.max_live_parameters,
        z.max_reuse_distance,
        z.memory_efficient_linear,
    )


def test_engine_without_a_json_is_an_empty_jsons_engine():
    """An ``Engine`` built in code and one read from a JSON that leaves every key out take the same defaults."""
    z3 = {"zero_optimization": {"stage": 3}}
    assert engine_from_ds_config(z3, "z3", "deepspeed") == Engine("z3", 3, overlap_comm=True)
    assert engine_from_ds_config(z3, "z3") == Engine("z3", 3, overlap_comm=True, layers=True, peer=True)  # default
    assert not engine_from_ds_config(z3, "z3", gather="collective").peer


@pytest.mark.parametrize(
    "block, want",
    [
        ({}, None),
        (None, None),
        ({"device": "none"}, None),
        ({"device": "cpu"}, "cpu"),
        ({"device": "nvme", "nvme_path": "/x"}, "nvme"),
    ],
)
def test_offload_device(block, want):
    cfg = {"zero_optimization": {"stage": 3, "offload_optimizer": block, "offload_param": block}}
    assert offload_device(cfg, "offload_optimizer") == want and offload_device(cfg, "offload_param") == want
    assert offload_device({}, "offload_param") is None


def test_non_number_size_is_refused_with_the_key_and_default():
    cfg = {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}
    with pytest.raises(
        DSConfigError,
        match=r"zero_optimization\.reduce_bucket_size must be a number, got 'auto'.*"
        r"default \(500,000,000\)",
    ):
        zero_settings(cfg)
    with pytest.raises(DSConfigError, match="reduce_bucket_size"):
        engine_from_ds_config(cfg)


def test_training_refuses_a_non_number_size_before_deepspeed_starts():
    from frod_ds.config.ds_config import resolve_ds_config
    from frod_ds.config.recipe import load_recipe

    cfg = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    cfg["zero_optimization"]["stage3_max_live_parameters"] = "1e9"
    recipe = load_recipe(None, ["model.base=m", "model.factor_store=f", "data.train=t.jsonl"])
    with pytest.raises(
        DSConfigError,
        match=r"zero_optimization\.stage3_max_live_parameters must be a number, "
        r"got '1e9'",
    ):
        resolve_ds_config(cfg, recipe, world_size=1)


def test_no_module_reads_zero_optimization_itself():
    """The DeepSpeed JSON's ZeRO block is read in frod_ds/config/ds_config.py and its checks, ds_checks.py, only (one
    home)."""
    reads = re.compile(
        r"""(\.get\(\s*|(?<!DS_DEFAULTS)\[\s*)["'](zero_optimization|offload_optimizer|offload_param)["']"""
    )
    offenders = [
        f"{p.relative_to(REPO)}:{i}"
        for base in ("frod_ds", "launch")
        for p in sorted((REPO / base).rglob("*.py"))
        if p.name not in ("ds_config.py", "ds_checks.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if reads.search(line)
    ]
    assert offenders == []


@pytest.mark.parametrize(
    "bf16, expected",
    [
        (None, True),
        ({"enabled": True}, True),
        ({"enabled": True, "check_grad_overflow": False}, False),
        ({"enabled": True, "check_grad_overflow": True}, True),
    ],
)
def test_bf16_overflow_check_is_read_as_deepspeed_reads_it(bf16, expected):
    from deepspeed.runtime import precision_config

    cfg = {} if bf16 is None else {"bf16": bf16}
    assert bf16_overflow_check(cfg) is expected
    assert precision_config.get_bfloat16_config(cfg).check_grad_overflow is expected
