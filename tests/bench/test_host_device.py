"""bench/host_device.py's CPU rehearsal: the models it times are FRoD on the default targets with the quantization
asked for, and its JSON has what bench/time_model_check.py reads."""

import json
import sys

import pytest
import torch


def test_models_carry_the_quantization_asked_for():
    pytest.importorskip("bitsandbytes")
    from bench.host_device import build
    from frod_ds.core.layer import FRoDLinear
    from frod_ds.core.names import DEFAULT_TARGETS
    from frod_ds.core.quant import QuantLinear, spec_of

    m = build("tiny", "nf4", True, torch.device("cpu"), torch.float32, 0.02)
    frod = {n.rpartition(".")[2] for n, mod in m.named_modules() if isinstance(mod, FRoDLinear)}
    assert frod == set(DEFAULT_TARGETS)
    assert all(spec_of(mod.U).kind == "nf4" for mod in m.modules() if isinstance(mod, FRoDLinear))
    base = [n for n, mod in m.named_modules() if isinstance(mod, QuantLinear)]
    assert base and all(n.endswith("down_proj") for n in base)
    layer = m.model.layers[0]
    assert layer.self_attn.q_proj.V is m.model.layers[1].self_attn.q_proj.V, "one V per category"
    dense = build("tiny", "none", False, torch.device("cpu"), torch.float32, 0.02)
    assert not any(isinstance(mod, QuantLinear) for mod in dense.modules())


def test_rehearsal_writes_every_configuration(tmp_path, monkeypatch):
    pytest.importorskip("bitsandbytes")
    from bench import host_device

    monkeypatch.setattr(
        sys, "argv", ["host_device.py", "--tiny", "--steps", "1", "--windows", "2", "--out", str(tmp_path)]
    )
    host_device.main()
    doc = json.loads((tmp_path / "host_device.json").read_text())
    assert [r["name"] for r in doc["runs"]] == ["tiny_none", "tiny_nf4", "tiny_nf4+base", "tiny_int8", "tiny_int8+base"]
    for r in doc["runs"]:
        assert len(r["all"]["step_ms"]) == 2 and r["step_ms"] > 0 and r["host"]["step_ms"] > 0
    assert doc["host_tokens"] == [1, 8] and doc["device"].startswith("cpu")
