"""QLoRA under ZeRO-3 (CPU, gloo, 2 ranks, a 2-layer LLaMA of hidden 256): the step kind's ``build_lora`` holds
its partition plus about one decoder layer of NF4 weights gathered, not the whole quantized model, and computes
what bitsandbytes' own ``Linear4bit`` computes.

tests/support/qlora_residency_probe.py runs both modes in one launch (NF4 base, checkpointing, one
optimizer step each) and samples, after each of DeepSpeed's fetches of a 4-bit linear, the NF4 bytes DeepSpeed
counts as gathered and the bytes of released gathers that are still alive. The expected sizes come from the model's
widths alone: an NF4 weight of m × n takes m·n/2 bytes. The DeepSpeed JSON is ``zero3.json`` without prefetching,
reuse window or persistent parameters (all three would keep more of a model this small gathered on purpose).
"""

from __future__ import annotations

import json

import pytest

from tests.support import ranks
from tests.support.train_env import REPO, env_vars

pytestmark = pytest.mark.slow
LAYERS, HIDDEN, INTER = 2, 256, 688


def _nf4_bytes(m: int, n: int) -> int:
    return m * n // 2  # two 4-bit codes per byte (the absmax scales live in quant_state, not in the parameter)


LAYER_BYTES = 4 * _nf4_bytes(HIDDEN, HIDDEN) + 3 * _nf4_bytes(INTER, HIDDEN)  # q k v o (MHA), gate up down


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    from bench.kinds.shapes import Shape, make_model

    root = tmp_path_factory.mktemp("qlora_zero3")
    make_model(Shape(LAYERS, HIDDEN, INTER, heads=8, kv_heads=8, vocab=1000), root / "m")
    probe = REPO / "tests" / "support" / "qlora_residency_probe.py"
    cmd = [str(probe), "--model", str(root / "m"), "--out", str(root / "out")]
    res = ranks.run(2, cmd, env_vars(), REPO, 300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return [json.loads((root / "out" / f"qlora_rank{r}.json").read_text()) for r in (0, 1)]


def test_qlora_zero3_holds_one_layer_of_nf4_weights_gathered(reports):
    for rep in reports:
        fixed = rep["fixed"]
        assert fixed["nf4_layer_bytes"] == [LAYER_BYTES] * LAYERS
        assert fixed["retained"] == 0, fixed
        assert fixed["both"] <= LAYER_BYTES, (fixed["both"], LAYER_BYTES)  # the layer recomputed in its backward


def test_qlora_under_zero3_recomputes_every_layer(reports):
    """``from_pretrained`` leaves the base in eval mode, where transformers' layers skip checkpointing: the step
    kind trains the engine, so each layer runs twice per step (forward, recompute in the backward)."""
    for rep in reports:
        assert rep["fixed"]["layer_passes_per_step"] == rep["stock"]["layer_passes_per_step"] == 2.0


def test_stock_bitsandbytes_keeps_every_gathered_weight_until_the_backward(reports):
    """The cause the fix removes: MatMul4Bit keeps a view of each gathered weight whose input needs a gradient —
    every one but the first layer's q/k/v, whose input is the frozen embedding's output."""
    for rep in reports:
        stock = rep["stock"]
        assert stock["retained"] == LAYERS * LAYER_BYTES - 3 * _nf4_bytes(HIDDEN, HIDDEN), stock


def test_qlora_zero3_fix_computes_what_bitsandbytes_computes(reports):
    for rep in reports:
        assert rep["fixed"]["losses"] == pytest.approx(rep["stock"]["losses"], rel=1e-6)
        # the backward's gradients (AdamW's first update is scale-free, so the LoRA values alone would not see a
        # wrongly scaled gradient of the 4-bit linears)
        assert rep["fixed"]["grad_norms"] == pytest.approx(rep["stock"]["grad_norms"], rel=1e-5)
        assert all(n > 0 for n in rep["stock"]["grad_norms"])
        for name, value in rep["stock"]["lora_layer0_q"].items():
            assert rep["fixed"]["lora_layer0_q"][name] == pytest.approx(value, rel=1e-5, abs=1e-8), name
