"""The DeepSpeed JSON checked against what the pinned DeepSpeed accepts (``frod_ds.config.ds_checks`` through
``ds_config``): a key given twice, a boolean written as a string, a value DeepSpeed's own config classes refuse, a
setting its ZeRO stage ignores. Each verdict is set against DeepSpeed itself: what ``json`` and ``DeepSpeedConfig``
make of the same JSON."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from frod_ds.config.ds_checks import ignored_settings
from frod_ds.config.ds_config import DSConfigError, check_ds_config, load_ds_config, resolve_ds_config
from frod_ds.config.recipe import load_recipe

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "ds_configs").glob("*.json"))

ds_config_module = pytest.importorskip("deepspeed.runtime.config")


def _shipped(name: str) -> dict:
    return json.loads((REPO / "ds_configs" / name).read_text())


def _deepspeed(cfg: dict):
    """DeepSpeed's own reading of ``cfg`` (batch sizes filled as a run would), or the exception it raises."""
    trial = copy.deepcopy(cfg)
    trial.pop("train_batch_size", None)
    trial.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    try:
        return ds_config_module.DeepSpeedConfig(trial)
    except Exception as e:  # noqa: BLE001
        return e


@pytest.mark.parametrize(
    "text, path",
    [
        ('{"zero_optimization": {"stage": 2, "overlap_comm": true, "stage": 3}}', '"zero_optimization"'),
        ('{"bf16": {"enabled": true}, "steps_per_print": 10, "bf16": {"enabled": false}}', "the top level"),
        (
            '{"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "device": "nvme"}}}',
            '"zero_optimization.offload_param"',
        ),
    ],
)
def test_a_key_given_twice_is_refused_naming_where(tmp_path, text, path):
    """json.loads keeps the last value without a word (so the run would use another stage or precision than the
    first line says); the reader refuses it and names the object."""
    assert isinstance(json.loads(text), dict)
    (tmp_path / "ds.json").write_text(text)
    with pytest.raises(DSConfigError, match=f"given twice in {path}"):
        load_ds_config(tmp_path / "ds.json")


def test_a_boolean_written_as_a_string_is_refused_before_it_reads_both_ways(tmp_path):
    """DeepSpeed reads "false" as false; a plain truth test (what frod-ds's bf16 check did) reads it as true: the two
    readings disagree, so the string is refused, and the recipe check no longer reports a contradiction."""
    cfg = {**_shipped("zero2_cpu_fp32.json"), "bf16": {"enabled": "false"}}
    assert _deepspeed(cfg).bfloat16_config.enabled is False and bool("false") is True
    with pytest.raises(DSConfigError) as err:
        check_ds_config(cfg, "ds.json")
    assert 'bf16.enabled is the string "false"; write false without quotes' in str(err.value)
    with pytest.raises(DSConfigError) as err:
        resolve_ds_config(cfg, load_recipe(None, ["model.dtype=float32"], paths=False), 1)
    assert "string" in str(err.value) and "make them agree" not in str(err.value)


@pytest.mark.parametrize(
    "edit, needle",
    [
        ({"zero_optimization": {"stage": 2, "reduce_bucket_size": -1}}, "zero_optimization.reduce_bucket_size"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}}, "offload_param.device"),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 2}}}, "ratio"),
        ({"fp16": {"enabled": False, "loss_scale": -1}}, "fp16.loss_scale"),
        ({"communication_data_type": "fp8"}, "communication_data_type"),
        ({"zero_optimization": {"stage": 3, "compute_grad_norm": False}}, "compute_grad_norm"),
    ],
)
def test_values_deepspeed_refuses_are_one_line(edit, needle):
    """The same JSON DeepSpeed's DeepSpeedConfig raises on (checked here first) is refused in one line naming the
    setting, instead of a traceback inside deepspeed.initialize."""
    cfg = {**_shipped("zero2_cpu_fp32.json"), **edit}
    assert isinstance(_deepspeed(cfg), Exception)
    with pytest.raises(DSConfigError) as err:
        check_ds_config(cfg, "ds.json")
    line = str(err.value)
    assert "\n" not in line and needle in line and "DeepSpeed 0.19.8 refuses it" in line, line


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_passes_as_deepspeed_reads_it_and_ignores_nothing(path, capsys):
    cfg = load_ds_config(path)
    assert not isinstance(_deepspeed(cfg), Exception)
    check_ds_config(cfg, path)
    assert "note:" not in capsys.readouterr().err


def test_steps_per_print_deepspeed_keeps_unchecked_is_refused():
    """DeepSpeed keeps a string steps_per_print as given (and fails on ``step % "often"`` mid-run)."""
    cfg = {**_shipped("zero2_cpu_fp32.json"), "steps_per_print": "often"}
    assert _deepspeed(cfg).steps_per_print == "often"
    with pytest.raises(DSConfigError, match="steps_per_print must be a positive integer, got 'often'"):
        check_ds_config(cfg, "ds.json")


def test_settings_the_stage_ignores_are_named_in_a_note(capsys):
    """ZeRO-3's settings in a ZeRO-2 JSON: DeepSpeed's ZeRO config keeps them, the stage-2 optimizer never reads
    them. Every stage3_* key DeepSpeed defines is in the ignored set (a newer DeepSpeed's key would show up here)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    stage3 = {f.alias for f in DeepSpeedZeroConfig.model_fields.values() if f.alias and f.alias.startswith("stage3_")}
    zo = {"stage": 2, "offload_param": {"device": "cpu"}, **{k: 0 for k in stage3}, "reduce_bucket_size": 1000}
    got = ignored_settings({"zero_optimization": zo}, 2, nvme=False)
    assert set(got) == {f"zero_optimization.{k}" for k in [*stage3, "offload_param"]}
    assert ignored_settings({"zero_optimization": zo}, 3, nvme=False) == []
    assert ignored_settings({"zero_optimization": {"stage": 0, "reduce_bucket_size": 1}}, 0, False) == [
        "zero_optimization.reduce_bucket_size"
    ]
    assert ignored_settings({"aio": {}, "fp16": {"enabled": False, "loss_scale": 0}}, 2, False) == [
        "fp16.loss_scale",
        "aio",
    ]
    cfg = {
        **_shipped("zero2_cpu_fp32.json"),
        "zero_optimization": {**zo, "stage3_gather_16bit_weights_on_model_save": True},
    }
    check_ds_config(cfg, "ds.json")
    err = capsys.readouterr().err
    assert err.count("note:") == 1 and "zero_optimization.offload_param" in err and "DeepSpeed ignores them" in err


def test_the_overflow_check_is_noted_only_where_deepspeeds_stage_3_runs(capsys):
    """``bf16.check_grad_overflow`` in a ZeRO-3 JSON: read under the layer partition (σ and S run under ZeRO-2),
    ignored by DeepSpeed's own stage 3 (``train.zero3_partition=deepspeed``, or a JSON that offloads to NVMe); CPU
    offload stays in the layer partition, which reads it."""
    cfg = _shipped("zero3.json")
    assert cfg["bf16"]["check_grad_overflow"] is False
    keys = ["model.base=m", "model.factor_store=f", "data.train=t.jsonl"]
    resolve_ds_config(cfg, load_recipe(None, keys), world_size=1)
    assert "note:" not in capsys.readouterr().err
    resolve_ds_config(cfg, load_recipe(None, [*keys, "train.zero3_partition=deepspeed"]), world_size=1)
    assert "bf16.check_grad_overflow has no effect" in capsys.readouterr().err
    for device, noted in (("cpu", False), ("nvme", True)):
        offloaded = {**cfg, "zero_optimization": {**cfg["zero_optimization"], "offload_param": {"device": device}}}
        check_ds_config(offloaded, "ds.json")
        assert ("bf16.check_grad_overflow" in capsys.readouterr().err) == noted, device


def test_zero3_only_recipe_choices_and_the_cpu_optimizer_switch_are_noted_where_they_do_nothing(capsys):
    """``train.zero3_partition`` / ``train.zero3_gather`` given under a ZeRO-2 JSON, and DeepSpeed's
    ``zero_force_ds_cpu_optimizer`` without an offloaded optimizer, change nothing: a note names each; the defaults,
    a ZeRO-3 JSON and an offloaded optimizer say nothing."""
    keys = ["model.base=m", "model.factor_store=f", "data.train=t.jsonl"]
    z2, z3 = _shipped("zero2.json"), _shipped("zero3.json")
    resolve_ds_config(z2, load_recipe(None, keys), world_size=1)
    assert "note:" not in capsys.readouterr().err
    for extra, said in (
        (["train.zero3_partition=layers"], "train.zero3_partition=layers has no effect with ZeRO stage 2"),
        (["train.zero3_gather=peer"], "train.zero3_gather=peer has no effect with ZeRO stage 2"),
        (
            ["train.zero3_partition=deepspeed", "train.zero3_gather=collective"],
            "train.zero3_partition=deepspeed and train.zero3_gather=collective have no effect with ZeRO stage 2",
        ),
    ):
        resolve_ds_config(z2, load_recipe(None, [*keys, *extra]), world_size=1)
        assert said in capsys.readouterr().err, extra
        resolve_ds_config(z3, load_recipe(None, [*keys, *extra]), world_size=1)
        assert "train.zero3_" not in capsys.readouterr().err  # a ZeRO-3 JSON reads them
    force = {**z2, "zero_force_ds_cpu_optimizer": False}
    check_ds_config(force, "ds.json")
    assert "zero_force_ds_cpu_optimizer has no effect" in capsys.readouterr().err
    offloaded = {**force, "zero_optimization": {**z2["zero_optimization"], "offload_optimizer": {"device": "cpu"}}}
    check_ds_config(offloaded, "ds.json")
    assert "note:" not in capsys.readouterr().err


def test_deepspeeds_activation_checkpointing_block_is_noted_as_without_effect(capsys):
    """frod-ds never configures ``deepspeed.checkpointing``: its ``activation_checkpointing`` block changes nothing,
    so a user who meant to checkpoint is pointed at the recipe's switch; the shipped JSONs have no such block."""
    cfg = _shipped("zero2_cpu_fp32.json")
    check_ds_config(cfg, "ds.json")
    assert "note:" not in capsys.readouterr().err
    check_ds_config({**cfg, "activation_checkpointing": {"partition_activations": True}}, "ds.json")
    err = capsys.readouterr().err
    assert "activation_checkpointing has no effect; set the recipe's model.gradient_checkpointing" in err


@pytest.mark.parametrize(
    "offload,optimizer,choice,want",
    [
        (None, None, "auto", "layers"),
        ("cpu", None, "auto", "layers"),
        ("cpu", "cpu", "auto", "layers"),
        ("cpu", None, "layers", "layers"),
        ("cpu", None, "deepspeed", "deepspeed"),
        ("nvme", None, "auto", "deepspeed"),
        ("cpu", "nvme", "auto", "deepspeed"),
        (None, "nvme", "auto", "deepspeed"),
        ("nvme", None, "layers", "refused"),
        (None, "nvme", "layers", "refused"),
    ],
)
def test_zero3_layout_takes_cpu_offload_into_the_layer_partition_not_nvme(offload, optimizer, choice, want):
    """``train.zero3_partition``: auto takes CPU offload into the layer partition (shards in host memory, measured
    faster than DeepSpeed's coordinator) and leaves anything on NVMe to DeepSpeed's stage 3; layers refuses NVMe
    in one line naming the way out (DeepSpeed's ZeRO-2 would keep an NVMe optimizer on the GPU silently)."""
    from frod_ds.config.ds_config import DSConfigError
    from frod_ds.config.zero3_layout import host_shards, zero3_layout

    zo: dict = {"stage": 3}
    if offload:
        zo["offload_param"] = {"device": offload}
    if optimizer:
        zo["offload_optimizer"] = {"device": optimizer}
    cfg = {"zero_optimization": zo}
    if want == "refused":
        with pytest.raises(DSConfigError, match="NVMe.*train.zero3_partition=auto"):
            zero3_layout(cfg, choice)
        return
    layout = zero3_layout(cfg, choice)
    assert layout == want
    assert host_shards(cfg, layout) == (layout == "layers" and offload == "cpu")
    assert zero3_layout({"zero_optimization": {**zo, "stage": 2}}, choice) is None


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_prescaled_or_predivided_gradients_deepspeed_asserts_on_are_refused(stage):
    """DeepSpeed's ZeRO-2 and ZeRO-3 optimizers assert, mid-start-up, that gradients are neither pre-scaled nor
    pre-divided when they reduce-scatter them (their default): refused with the JSON; fine under ZeRO-1, and with
    reduce_scatter false. The pinned DeepSpeed's own source holds both assertions."""
    import inspect

    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    for cls in (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3):
        src = inspect.getsource(cls.__init__)
        assert "pre-scale gradients is not yet supported" in src and "gradient_predivide_factor != 1.0" in src
    base = _shipped("zero2_cpu_fp32.json")
    for extra, said in (
        ({"prescale_gradients": True}, f"prescale_gradients true is not supported by DeepSpeed's ZeRO-{stage}"),
        (
            {"gradient_predivide_factor": 2.0},
            f"gradient_predivide_factor 2.0 is not supported by DeepSpeed's ZeRO-{stage}",
        ),
    ):
        cfg = {**base, **extra, "zero_optimization": {**base["zero_optimization"], "stage": stage}}
        if stage == 1:
            check_ds_config(cfg, "ds.json")
            continue
        with pytest.raises(DSConfigError, match=re.escape(said)):
            check_ds_config(cfg, "ds.json")
        cfg["zero_optimization"]["reduce_scatter"] = False
        check_ds_config(cfg, "ds.json")


@pytest.mark.parametrize(
    ("key", "said"),
    [
        ("cpu_offload", 'write "offload_optimizer": {"device": "cpu"} instead'),
        ("cpu_offload_param", 'write "offload_param": {"device": "cpu"} instead'),
        ("cpu_offload_use_pin_memory", 'write "pin_memory" in offload_optimizer / offload_param instead'),
    ],
)
def test_deepspeeds_deprecated_offload_switches_are_refused_naming_their_successors(key, said):
    """``zero_optimization.cpu_offload: true`` passes DeepSpeed's config class (deprecated, mapped to ZeRO-Offload),
    then its engine refuses the client optimizer with a traceback; refused with the JSON, naming what to write."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    assert DeepSpeedZeroConfig.model_fields[key].json_schema_extra.get("deprecated") is True
    base = _shipped("zero2_cpu_fp32.json")
    cfg = {**base, "zero_optimization": {**base["zero_optimization"], key: True}}
    with pytest.raises(DSConfigError, match=re.escape(f"zero_optimization.{key} is DeepSpeed's deprecated switch")):
        check_ds_config(cfg, "ds.json")
    with pytest.raises(DSConfigError, match=re.escape(said)):
        check_ds_config(cfg, "ds.json")
