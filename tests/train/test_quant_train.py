"""Quantized frozen weights end to end (CPU, gloo, 2 ranks): build → ZeRO-3 training with NF4 U_i and an NF4
base → adapter → eval rebuild → export; ZeRO-2 (with gradient checkpointing) takes the same steps; a quantized
store given to a dense recipe, and an unknown frozen_quant, are refused with one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.support.helpers_ckpt import hjd_in_process
from tests.support.train_env import CPU_ZERO2, CPU_ZERO3, REPO, build_env, metrics, run_train, train_in_process

pytestmark = pytest.mark.slow
PROBE = REPO / "tests" / "support" / "train_probe.py"
QUANT = {
    "model.frozen_quant": "nf4",
    "model.quantize_base": "true",
    "train.max_steps": 2,
    "train.schedule": "constant",
    "train.warmup_ratio": 0.0,
}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return build_env(tmp_path_factory.mktemp("quantenv"))


@pytest.fixture(scope="module")
def zero3(env, tmp_path_factory):
    """Two optimizer steps under DeepSpeed's ZeRO-3 on 2 ranks, NF4 everywhere, inspected by train_probe.py."""
    out = tmp_path_factory.mktemp("z3nf4")
    extra = {"train.save_every": 1, "train.rotation_every": 2, "train.zero3_partition": "deepspeed"}
    res = run_train(CPU_ZERO3, env.overrides(out, **QUANT, **extra), script=PROBE)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out, [json.loads((out / f"probe_rank{r}.json").read_text()) for r in (0, 1)]


def test_quantized_factors_are_partitioned_under_zero3(zero3):
    from frod_ds.core.quant import QuantSpec

    _, reports = zero3
    for rep in reports:
        assert rep["zero3"] and rep["frozen_grads_none"] and not rep["frozen_in_optimizer"]
        assert rep["trainable_leaves"] == ["frod_s", "frod_sigma"]
        assert rep["param_dtypes"] == ["torch.float32"]
        for name, p in rep["partition"].items():
            m, n = (
                (16, 32)
                if name.endswith(("k_proj", "v_proj"))
                else (48, 32)
                if name.endswith(("gate_proj", "up_proj"))
                else (32, 32)
            )
            assert p["U_full"] == QuantSpec("nf4", (m, n)).storage_numel(torch.float32), (
                name
            )  # the blob, 4.5 bits/weight
            assert 0 < p["U_local"] < p["U_full"], (name, p)


@pytest.fixture(scope="module")
def zero2_gc(env, tmp_path_factory):
    """The same two steps under ZeRO-2 with gradient checkpointing."""
    out = tmp_path_factory.mktemp("z2nf4")
    res = run_train(CPU_ZERO2, env.overrides(out, **QUANT, **{"model.gradient_checkpointing": "true"}))
    assert res.returncode == 0, res.stderr[-3000:]
    return out


def test_zero2_with_checkpointing_takes_the_same_quantized_steps(zero3, zero2_gc):
    out3, _ = zero3
    z2, z3 = metrics(zero2_gc)[-1], metrics(out3)[-1]
    assert z2["step"] == z3["step"] == 2
    assert z2["loss"] == pytest.approx(z3["loss"], rel=1e-5)
    assert z2["grad_norm"] == pytest.approx(z3["grad_norm"], rel=1e-4)
    a = load_file(str(zero2_gc / "adapter-final" / "adapter.safetensors"))
    b = load_file(str(out3 / "adapter-final" / "adapter.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6), k


def test_layer_partition_takes_zero2s_quantized_steps_exactly(env, zero2_gc, tmp_path):
    """zero3.json's layer partition with NF4 U_i and an NF4 base (uint8 blobs gathered by decoder layer beside the
    fp32 tensors) and checkpointing: ZeRO-2's losses, gradient norms and adapter, bitwise."""
    out = tmp_path / "layers"
    res = run_train(CPU_ZERO3, env.overrides(out, **QUANT, **{"model.gradient_checkpointing": "true"}))
    assert res.returncode == 0, res.stderr[-3000:]
    got, want = metrics(out), metrics(zero2_gc)
    assert [(r["loss"], r["grad_norm"]) for r in got] == [(r["loss"], r["grad_norm"]) for r in want]
    a = load_file(str(zero2_gc / "adapter-final" / "adapter.safetensors"))
    b = load_file(str(out / "adapter-final" / "adapter.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_adapter_records_quantization_and_eval_rebuilds_the_trained_model(zero3, tmp_path):
    """load_frod_model rebuilds the NF4 model from adapter_config.json alone (same logits as the engine's);
    the export merges the dequantized U (and writes the dequantized base linears): stock transformers agrees."""
    from transformers import LlamaForCausalLM

    from frod_ds.core.quant import QuantLinear
    from frod_ds.model.adapter import load_frod_model, read_adapter
    from launch.export import main as export_main

    out, _ = zero3
    _, cfg = read_adapter(out / "adapter-final")
    assert cfg.frozen_quant == "nf4" and cfg.quantize_base is True
    model, _ = load_frod_model(out / "adapter-final")
    assert isinstance(model.model.layers[0].mlp.down_proj, QuantLinear)
    ids = torch.arange(3, 3 + 2 * 12).reshape(2, 12) % model.config.vocab_size
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    assert torch.allclose(logits, torch.load(out / "probe_logits.pt"), atol=1e-5, rtol=1e-5)

    assert export_main(["--checkpoint", str(out / "adapter-final"), "--out", str(tmp_path / "merged")]) == 0
    prov = json.loads((tmp_path / "merged" / "frod_export.json").read_text())
    assert prov["frozen_quant"] == "nf4" and prov["quantize_base"] is True
    plain = LlamaForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (plain(input_ids=ids).logits - logits).abs().max().item() < 1e-4


def _refused(res):
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    lines = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, res.stderr[-2000:]
    return lines[0]


def test_quantized_store_given_to_a_dense_recipe_is_refused(env, tmp_path):
    store = tmp_path / "nf4store"
    proc = hjd_in_process(["--model", str(env.model), "--out", str(store), "--quant", "nf4"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = tmp_path / "bad"
    res = train_in_process(CPU_ZERO3, env.overrides(out, **{"model.factor_store": store}))
    line = _refused(res)
    assert "nf4-quantized U" in line and "model.frozen_quant=nf4" in line, line
    assert not (out / "metrics.jsonl").exists()


def test_unknown_frozen_quant_is_refused(env, tmp_path):
    res = train_in_process(CPU_ZERO3, env.overrides(tmp_path / "bad", **{"model.frozen_quant": "nf5"}))
    assert "model.frozen_quant must be one of none, int8, nf4, got 'nf5'" in _refused(res)
