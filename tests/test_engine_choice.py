"""The ZeRO choice rule (frod_ds/engine_choice.py) and the hint launch/train.py prints from it."""

from __future__ import annotations

import json

import pytest

from frod_ds.engine_choice import FIT_FRACTION, ZeroChoice, choice_of_config, recommend_zero, zero_hint
from tests.helpers_ckpt import REPO, write_tiny_llama

GB = 10**9
Z2, Z3, Z3_OFF = ZeroChoice(2, False), ZeroChoice(3, False), ZeroChoice(3, True)


@pytest.mark.parametrize("frozen_gb, gpu_gb, world, want", [
    (13.5, 80, 1, Z2),  # LLaMA-2-7B bf16 on one H100
    (13.5, 80, 4, Z2),
    (138, 80, 1, Z3_OFF),  # LLaMA-2-70B bf16
    (138, 80, 8, Z3),
    (138, 141, 2, Z3),  # two H200s: 69 GB each, under half of 141
    (26, 40, 1, Z3_OFF),  # 13B on one 40 GB card
    (26, 40, 2, Z3),
])
def test_recommend_zero_is_the_fastest_setup_that_fits(frozen_gb, gpu_gb, world, want):
    assert recommend_zero(int(frozen_gb * GB), int(gpu_gb * GB), world) == want


def test_recommend_zero_boundary_is_fit_fraction_of_one_gpu():
    g = 80 * GB
    assert recommend_zero(int(FIT_FRACTION * g), g, 1) == Z2
    assert recommend_zero(int(FIT_FRACTION * g) + 1, g, 1) == Z3_OFF
    assert recommend_zero(int(FIT_FRACTION * g) + 1, g, 2) == Z3


def test_shipped_configs_map_to_their_setup():
    cfgs = {p.stem: json.loads(p.read_text()) for p in (REPO / "ds_configs").glob("*.json")}
    assert choice_of_config(cfgs["zero2"]) == Z2 and choice_of_config(cfgs["zero2_cpu_fp32"]) == Z2
    assert choice_of_config(cfgs["zero3"]) == Z3 and choice_of_config(cfgs["zero3_cpu_fp32"]) == Z3
    assert choice_of_config(cfgs["zero3_offload"]) == Z3_OFF and choice_of_config(cfgs["zero3_nvme"]) == Z3_OFF
    for choice in (Z2, Z3, Z3_OFF):
        assert (REPO / choice.config).is_file()


def test_zero_hint_names_the_faster_or_the_fitting_config():
    seven, seventy, h100 = int(13.5 * GB), 138 * GB, 80 * GB
    assert zero_hint(Z2, seven, h100, 1) is None and zero_hint(Z3, seventy, h100, 8) is None
    slow = zero_hint(Z3, seven, h100, 4)
    assert slow.startswith("hint:") and "ds_configs/zero2.json" in slow and "\n" not in slow
    assert "ds_configs/zero2.json" in zero_hint(Z3_OFF, seven, h100, 1)
    oom = zero_hint(Z2, seventy, h100, 8)
    assert "out of memory" in oom and "ds_configs/zero3.json" in oom
    assert "ds_configs/zero3_offload.json" in zero_hint(Z3, seventy, h100, 1)
    assert "ds_configs/zero3.json" in zero_hint(Z3_OFF, seventy, h100, 8)


def test_train_hint_line_counts_the_frozen_model_from_checkpoint_and_store(tmp_path):
    """launch/train.py's hint: frozen bytes = checkpoint tensors (U_i has W_i's shape) + one V per category."""
    from launch.train import zero_hint_line
    from frod_ds.hjd_stage import StageConfig, run_stage
    from frod_ds.recipe import load_recipe
    from transformers import AutoModelForCausalLM

    model_dir = write_tiny_llama(tmp_path / "m")
    run_stage(StageConfig(model=str(model_dir), out=tmp_path / "store", device="cpu", fsync=False))
    recipe = load_recipe(None, [f"model.base={model_dir}", f"model.factor_store={tmp_path / 'store'}",
                                "model.dtype=bfloat16", "data.train=unused.jsonl"])
    base = AutoModelForCausalLM.from_pretrained(str(model_dir))
    widths = {name.rsplit(".", 1)[-1]: m.in_features for name, m in base.named_modules()
              if name.rsplit(".", 1)[-1] in recipe.model.targets}
    frozen = (sum(p.numel() for p in base.parameters()) + sum(n * n for n in widths.values())) * 2  # bf16
    z2, z3 = str(REPO / "ds_configs" / "zero2.json"), str(REPO / "ds_configs" / "zero3.json")

    assert zero_hint_line(recipe, z3, 1, None) is None, "no GPU: no hint"
    roomy = int(frozen / FIT_FRACTION)  # exactly fits under ZeRO-2
    assert zero_hint_line(recipe, z2, 1, roomy) is None
    assert "ds_configs/zero2.json" in zero_hint_line(recipe, z3, 1, roomy)
    tight = roomy - 2  # one byte short of fitting
    assert "ds_configs/zero3" in zero_hint_line(recipe, z2, 1, tight)
    assert zero_hint_line(recipe, z3, 2, tight) is None, "partitioned over 2 GPUs it fits"
    assert zero_hint_line(recipe, str(tmp_path / "missing.json"), 1, roomy) is None, "setup reports bad input"
